"""Every run-config field as a command-line flag: `--batch-size` for
[train] batch_size (config.flag_of names them), its help read from the
comment beside the field, its type from the field's, so that the dataclasses
in sections.py are the one place a field is described."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize

from zero_jax.config.load import build, field_type, flag_of
from zero_jax.config.sections import SECTIONS, ConfigError, RunConfig


@functools.cache
def field_comments(cls) -> dict[str, str]:
    """{field: its comment} read from the class's source: the comment after the
    field on its line, else the comment lines right above it. The comments are
    the one place each field is described, so --help reads them from there."""
    try:
        lines = textwrap.dedent(inspect.getsource(cls)).splitlines(keepends=True)
    except (OSError, TypeError):  # no source to read (a frozen build): no texts
        return {}
    source = "".join(lines)
    comments = {t.start[0]: t.string.lstrip("#").strip()
                for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT}
    alone = {row for row in comments if lines[row - 1].lstrip().startswith("#")}
    out = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if node.end_lineno in comments:
            out[node.target.id] = comments[node.end_lineno]
            continue
        row, above = node.lineno - 1, []
        while row in alone:
            above.insert(0, comments[row])
            row -= 1
        if above:
            out[node.target.id] = " ".join(above)
    return out


def _help(cls, field: dataclasses.Field) -> str:
    """A flag's help: the field's comment and its default (argparse reads % as a format)."""
    text = field_comments(cls).get(field.name, "")
    return f"{text} (default: {field.default!r})".strip().replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; defaults are None so only given flags override."""
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"[{section}]")
        for f in dataclasses.fields(cls):
            kind = field_type(cls, f)
            flag = flag_of(section, f.name)
            if kind is bool:
                group.add_argument(flag, dest=f"{section}.{f.name}", default=None,
                                   action=argparse.BooleanOptionalAction, help=_help(cls, f))
            else:
                group.add_argument(flag, dest=f"{section}.{f.name}", type=kind, default=None,
                                   metavar=kind.__name__.upper(), help=_help(cls, f))


def from_args(args: argparse.Namespace, config_file: str | None) -> RunConfig:
    """The run config of parsed flags (`add_flags`) over `config_file`'s."""
    given = {k: v for k, v in vars(args).items() if "." in k}
    run = build(config_file, given)
    check_wandb(run, given, config_file)
    return run


def check_wandb(run: RunConfig, given: dict, config_file: str | None) -> None:
    """A W&B mode with no project to log to would be ignored: refused."""
    t = run.train
    if t.wandb_project:
        return
    mode = given.get("train.wandb_mode")
    if mode is not None:
        raise ConfigError(f"{flag_of('train', 'wandb_mode')} {mode}: no W&B project to log to; "
                          f"give {flag_of('train', 'wandb_project')} NAME (or wandb_project in "
                          "the config's [train]), or leave the mode out")
    if config_file and given.get("train.wandb_project") is None and t.wandb_mode != "online":
        raise ConfigError(f"{config_file}: [train] wandb_mode = {t.wandb_mode!r} but no "
                          f"wandb_project: nothing would be logged; set wandb_project (or "
                          f"{flag_of('train', 'wandb_project')} NAME), or remove wandb_mode")
