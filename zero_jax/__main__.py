"""`python -m zero_jax SUBCOMMAND [args]` is `zero-jax SUBCOMMAND [args]`
(what `zero-jax launch` runs for a `zero-jax` program)."""

import sys

from zero_jax.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
