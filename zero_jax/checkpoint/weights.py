"""Parameters from where a user keeps them, placed in a job's layout (a
zero_jax.job.Job, read through its state plan and config): a checkpoint
directory, a consolidated .safetensors file, or a format a loader
recognises (a Hugging Face directory: models.hf_loader).

Under LoRA, the frozen base too. Checkpoints hold the adapters only, so
the base is read again where it came from (`--init-from`, else the
model's initialisation from the seed), and each checkpoint names it by a
digest of its arrays' layout-independent checksums (integrity.py): a
resume onto another base is refused, not trained on silently.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from zero_jax.checkpoint import export, integrity, stream
from zero_jax.checkpoint import manager as manager_lib

# (path, job) -> the parameters placed in the job's layout (None: not this format)
ParamLoader = Callable[[str, Any], Any]


class InitFromError(ValueError):
    """--init-from names something that does not load into the model."""


def load_params(source: str, job: Any, loaders: list[ParamLoader] = ()) -> Any:
    """Parameters from a checkpoint directory, a consolidated .safetensors file, or
    a format one of `loaders` recognises (a loader returns the parameters
    placed in the job's layout, or None), laid out for `job`."""
    path = Path(source)
    for loader in loaders:
        tree = loader(source, job)
        if tree is not None:
            return tree
    if path.suffix == ".safetensors":
        return place(export.read_consolidated(path, job.state_plan.names), job)
    checkpointer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(path)))
    steps = checkpointer.complete_steps()
    if not steps:
        raise FileNotFoundError("no complete checkpoint, .safetensors file or known weights "
                                "directory there")
    params, _ = checkpointer.restore(steps[-1], job.state_plan.targets, params_only=True)
    return params


def place(tree: Any, job: Any, log: Callable[[str], None] = print) -> Any:
    """Numpy parameters -> master weights in the job's layout, checked leaf by leaf."""
    want, have = integrity.flatten(job.state_plan.master_params), integrity.flatten(tree)
    problems = [f"{p}: in the model, not in the weights" for p in sorted(want.keys() - have.keys())]
    problems += [f"{p}: in the weights, not in the model" for p in sorted(have.keys() - want.keys())]
    problems += [f"{p}: shape {tuple(np.shape(have[p]))}, the model has {want[p].shape}"
                 for p in sorted(want.keys() & have.keys()) if tuple(np.shape(have[p])) != want[p].shape]
    if problems:
        raise ValueError("the weights do not fit the model:\n  " + "\n  ".join(problems))
    cast = sorted({f"{np.asarray(have[p]).dtype} -> {want[p].dtype}" for p in want
                   if np.asarray(have[p]).dtype != want[p].dtype})
    if cast:
        log(f"imported weights converted to the model's dtypes: {', '.join(cast)}")
    # Each leaf cast to its dtype as it is placed, so a bf16 file is never
    # held whole in float32 on the host.
    return jax.tree.map(lambda x, a, s: stream.put(np.asarray(x), a.dtype, s),
                        tree, job.state_plan.master_params, job.state_plan.named(job.state_plan.master_specs))


def base(job: Any, loaders: list[ParamLoader] = ()) -> tuple[Any, str | None]:
    """Under LoRA, the frozen base as stored (in its layout and dtype,
    quantized where asked) and its digest: `--init-from`'s weights, whose
    digest is over them in the compute dtype before any quantization (what
    --merge-lora reads on the host), else the model's initialisation (the
    seed's), as stored. (None, None) without LoRA."""
    if job.state_plan.frozen_names is None:
        return None, None
    init_from = job.run.checkpoint.init_from
    if not init_from:
        frozen = job.init_state().frozen
        return frozen, digest(frozen)
    try:
        params = load_params(init_from, job.base_job(), loaders)
    except (ValueError, FileNotFoundError) as e:
        raise InitFromError(f"--init-from {init_from}: {e}") from None
    return job.state_plan.cast_base(params), digest(params, job.policy.dtype("compute"))


def adapters(job: Any, loaders: list[ParamLoader] = ()) -> Any:
    """Under LoRA, `--lora-init-from`'s adapters in the job's layout: a
    format a loader reads (a peft directory: models.peft_loader), or a LoRA
    run's checkpoint."""
    source = job.run.lora.init_from
    try:
        return load_params(source, job, loaders)
    except (ValueError, FileNotFoundError) as e:
        raise InitFromError(f"--lora-init-from {source}: {e}") from None


def digest(frozen: Any, dtype=None) -> str:
    """One SHA-256 over the base's per-array checksums (in `dtype`): the
    same under any layout."""
    sums = integrity.checksums(frozen, dtype)
    return hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()


def _source(job: Any) -> dict[str, Any]:
    """Where this run's base comes from: --init-from (resolved), else the seed."""
    init_from, quantized = job.run.checkpoint.init_from, job.run.lora.quantize_base
    return {"init_from": str(Path(init_from).resolve()) if init_from else "",
            "seed": job.run.train.seed, **({"quantize_base": quantized}
                                           if quantized != "none" else {})}


def _named(source: dict[str, Any]) -> str:
    quantized = source.get("quantize_base", "none")
    return ((f"--init-from {source['init_from']}" if source["init_from"] else
             f"the initialisation of seed {source['seed']}")
            + (f", stored {quantized}" if quantized != "none" else ""))


def base_meta(job: Any, base_digest: str | None) -> dict[str, Any]:
    """What a LoRA checkpoint records of its base (`base`'s digest; {} without LoRA)."""
    if base_digest is None:
        return {}
    return {"lora_base": {**_source(job), "digest": base_digest}}


class WrongBase(InitFromError):
    """A LoRA checkpoint resumed onto a base its adapters were not trained on."""


def check_base_source(job: Any) -> None:
    """Before compiling: a LoRA --resume whose newest checkpoint's base came
    from elsewhere than this run's is refused (`check_base` checks the
    weights themselves once they are read)."""
    c = job.run.checkpoint
    steps = manager_lib.complete_steps(c.dir) if c.dir and c.resume else []
    if job.state_plan.frozen_names is None or not steps:
        return
    try:
        meta = manager_lib.read_meta(Path(c.dir) / str(steps[-1]))
    except manager_lib.CheckpointError:
        return  # the resume falls back past it, and checks the one it takes
    _same_source(meta, job, Path(c.dir) / str(steps[-1]))


def _same_source(meta: dict[str, Any], job: Any, where: Path) -> dict[str, Any]:
    saved, now = meta.get("lora_base"), _source(job)
    if saved is None:
        raise WrongBase(f"{where} was not saved by a LoRA run (no lora_base in its meta): "
                        "resume it without --lora-rank, or start the adapters afresh in "
                        "another --checkpoint-dir")
    if _named(saved) != _named(now):
        fix = f"--init-from {saved['init_from']}" if saved["init_from"] else \
            f"--seed {saved['seed']} and no --init-from"
        if (q := saved.get("quantize_base", "none")) != now.get("quantize_base", "none"):
            fix += f", with --lora-quantize-base {q}"
        raise WrongBase(f"{where}: its adapters were trained on the base from {_named(saved)}, "
                        f"this run's comes from {_named(now)}; give {fix}")
    return saved


def check_base(meta: dict[str, Any], base_digest: str, job: Any, where: Path) -> None:
    """A LoRA checkpoint resumes only onto the base its adapters were trained
    on: from the same source, with the same weights (`base`'s digest)."""
    saved = _same_source(meta, job, where)
    if saved["digest"] != base_digest:
        raise WrongBase(f"{where}: its adapters were trained on the base from {_named(saved)}, "
                        f"whose weights have changed since (digest {base_digest[:12]}, "
                        f"saved {saved['digest'][:12]}); give the base they were trained on")
