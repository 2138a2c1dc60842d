"""`zero-jax train` (zero_jax/cli/train.py): train a model with ZeRO sharding on a device mesh."""

import sys

from zero_jax.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
