"""`zero-jax bench` (zero_jax/cli/bench.py): the benchmark suite."""

import sys

from zero_jax.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
