"""A planned layout as the files `zero-jax train --config` reads: a mesh.toml
of its [ici] and [dcn] axis sizes and a run.toml of every run-config field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
          cluster: Cluster) -> None:
    """DIR/mesh.toml and DIR/run.toml of `choice` on top of `base`; the run
    names the mesh file by its absolute path, so it runs from anywhere."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "mesh.toml").write_text(mesh_toml(choice, cluster))
    flat = choice.flat(base)
    flat["parallel.mesh"] = str((directory / "mesh.toml").absolute())
    (directory / "run.toml").write_text(run_toml(flat))
