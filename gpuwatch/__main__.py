"""``python -m gpuwatch`` is the ``gpuwatch`` command."""

import os

if os.environ.get("GPUWATCH_TESTING_SIMKERNEL"):  # tests only: docs/switch.md, "Testing"
    from gpuwatch.testing.simkernel import install_saved_backend

    install_saved_backend(os.environ["GPUWATCH_TESTING_SIMKERNEL"])

from gpuwatch.cli.main import main

raise SystemExit(main())
