"""`python -m gpuguard.cli COMMAND`: the same entry point as `gpuguard` and `python -m gpuguard`."""
from gpuguard.cli import main

raise SystemExit(main())
