"""The driver switch: a GPU's whole IOMMU group between vfio-pci and nvidia (docs/switch.md).

The executor (`engine`) over the one seam for host side effects (`hostops`). The plan it
executes is pure (`gpuwatch.core.plan`); its errors live with every other in `gpuwatch.errors`.
"""
