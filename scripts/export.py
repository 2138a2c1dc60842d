"""`zero-jax export` (zero_jax/cli/export.py): a checkpoint's parameters as consolidated weights."""

import sys

from zero_jax.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
