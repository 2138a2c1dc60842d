"""A planned layout as the files `zero-jax train --config` reads: a mesh.toml
of its [ici] and [dcn] axis sizes and a run.toml of every run-config field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zero_jax.config import DATA_PLACEHOLDER
from zero_jax.planner.choices import Choice, Cluster


def mesh_toml(choice: Choice, cluster: Cluster) -> str:
    mesh = choice.mesh(cluster)
    lines = [f'description = "{choice.label} on {cluster.size} x {cluster.device.name}"']
    for table in ("ici", "dcn"):
        lines.append(f"\n[{table}]")
        lines += [f"{a} = {s}" for a, s in mesh[table].items() if s > 1] or ["data = 1"]
    return "\n".join(lines) + "\n"


def run_toml(flat: dict[str, Any]) -> str:
    """Run-config fields (section.field) as TOML tables, one per section."""
    sections: dict[str, dict] = {}
    for key, value in flat.items():
        section, field = key.split(".")
        sections.setdefault(section, {})[field] = value
    out = []
    for section, fields in sections.items():
        out.append(f"[{section}]")
        out += [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
        out.append("")
    return "\n".join(out)


def write(directory: Path, choice: Choice, base: dict[str, Any],
          cluster: Cluster) -> tuple[Path, Path]:
    """DIR/mesh.toml and DIR/run.toml of `choice` on top of `base`. The run
    names its mesh by a path relative to itself (found beside the config,
    config.build) and its data by a placeholder train.py refuses until it is
    set: the pair runs from wherever it is copied to."""
    directory.mkdir(parents=True, exist_ok=True)
    mesh, run = directory / "mesh.toml", directory / "run.toml"
    mesh.write_text(mesh_toml(choice, cluster))
    flat = {**choice.flat(base), "parallel.mesh": mesh.name, "data.source": DATA_PLACEHOLDER}
    run.write_text(f"# {choice.label} on {cluster.size} x {cluster.device.name}: set [data] "
                   f"source, then zero-jax train --config {run.name}\n" + run_toml(flat))
    return mesh, run
