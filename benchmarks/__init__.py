"""gpuwatch's benchmark suite: ``python benchmarks/run.py [--quick] [--json PATH]``.

A package so the smoke test can import the measuring pieces; see docs/performance.md.
"""
