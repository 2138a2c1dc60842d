"""`zero-jax launch` (zero_jax/cli/launch.py): start N processes of a JAX program on this machine."""

import sys

from zero_jax.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
