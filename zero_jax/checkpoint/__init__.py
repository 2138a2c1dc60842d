"""Sharded checkpoints: the orbax manager, layout-independent checksums,
consolidated export and streamed import of weights."""
