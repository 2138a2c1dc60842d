"""`zero-jax prepare-data` (zero_jax/cli/prepare_data.py): tokenize a corpus into shards."""

import sys

from zero_jax.cli.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
