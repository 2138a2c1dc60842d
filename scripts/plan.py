"""`zero-jax plan` (zero_jax/cli/plan.py): search a cluster run's layouts and rank them."""

import sys

from zero_jax.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
