"""The `zero-jax` command: one module per subcommand."""
