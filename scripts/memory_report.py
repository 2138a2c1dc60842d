"""`zero-jax memory` (zero_jax/cli/memory_report.py): bytes per device of a training run, without allocating the model."""

import sys

from zero_jax.cli.memory_report import main

if __name__ == "__main__":
    sys.exit(main())
