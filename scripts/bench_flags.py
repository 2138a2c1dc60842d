"""The run-shape flags the benchmark and check scripts share, with one help
text each; a script passes the defaults of those it takes."""

from __future__ import annotations

import argparse

HELP = {
    "model": "model preset in models/",
    "mesh": "a meshes/ name, a TOML path, or inline like data=2,fsdp=4",
    "zero_stage": "0 DDP, 1 optimizer state, 2 + gradients, 3 + parameters",
    "precision": "precision policy: fp32 | bf16 | fp16",
    "seq_len": "tokens per row",
    "batch_size": "global batch, in rows",
}


def add(parser: argparse.ArgumentParser, **defaults) -> None:
    """`--model`, `--mesh`, ... for each keyword given, in HELP's order."""
    for name, text in HELP.items():
        if name in defaults:
            value = defaults[name]
            parser.add_argument("--" + name.replace("_", "-"), default=value,
                                type=type(value), help=f"{text} (default: %(default)s)")
