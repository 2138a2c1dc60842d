"""Options that each work alone but not together, refused in one line
before anything compiles, and the choices they resolve: the ZeRO stage
with offload, quantized collectives and a pipeline; an expert axis with
its model; where gradients are reduced; LoRA with what it cannot train
beside."""

from __future__ import annotations

from zero_jax.config import sections as config_lib
from zero_jax.model import lora
from zero_jax.model.contract import ModelFns
from zero_jax.pipeline import schedule as schedule_lib
from zero_jax.sharding import mesh as mesh_lib
from zero_jax.sharding import quantized
from zero_jax.sharding import zero as zero_lib


def lora_of(run: config_lib.RunConfig, pipe: int) -> lora.Lora | None:
    """The adapters [lora] asks for, refused before compiling where the run
    would train something else than they and the base would compute."""
    try:
        adapters = lora.of(run.lora, run.train.seed)
    except ValueError as e:
        raise config_lib.ConfigError(str(e)) from None
    if adapters is None:
        if run.lora.init_from:
            raise config_lib.ConfigError(f"--lora-init-from {run.lora.init_from}: no adapters "
                                         "to start: give --lora-rank too")
        return None
    rank = f"--lora-rank {run.lora.rank}"
    if pipe > 1:
        raise config_lib.ConfigError(f"{rank} with pipe={pipe} (adapters are not cut into "
                                     "stages yet) is not supported; train every parameter "
                                     "(--lora-rank 0), or a mesh without pipe")
    return adapters


def adapters_found(run: config_lib.RunConfig, adapters: lora.Lora | None, found: bool) -> None:
    """Adapters asked for where the model has none of the projections named."""
    if adapters and not found:
        raise config_lib.ConfigError(f"--lora-targets {run.lora.targets}: {run.model.name} has "
                                     "none of these projections; the Llama family's are "
                                     "named in docs/lora.md")


def check_combination(run: config_lib.RunConfig, zero_stage: int, shape: mesh_lib.MeshShape,
                      pipelined: bool) -> None:
    """Options that each work but not together with the stage or a pipeline."""
    check_grad_reduce(run.parallel.grad_reduce, zero_stage)
    pipe = shape.sizes["pipe"]
    if run.offload.optimizer and not zero_lib.stage(zero_stage).opt_state:
        raise config_lib.ConfigError(
            f"[offload] optimizer = true with --zero-stage {zero_stage}: the optimizer state is "
            "replicated at stage 0, so every device would keep a whole copy in host memory and "
            "update it there; use --zero-stage 1 or more to offload each device's shard")
    quantized.check(run.zero, zero_stage, pipelined, run.parallel.grad_reduce, shape.shard_axes)
    if run.offload.params and not zero_lib.stage(zero_stage).params:
        raise config_lib.ConfigError(
            f"[offload] params = true with --zero-stage {zero_stage}: only ZeRO-3 gathers each "
            "layer's parameters where they are used, so only there can they be fetched from host "
            "memory layer by layer; use --zero-stage 3, or --offload-optimizer alone")
    if run.data.segment_ids and pipelined:
        raise config_lib.ConfigError(
            f"--segment-ids with pipe={pipe}: document masking is not carried "
            "through pipeline stages; use pipe=1, or train without --segment-ids")
    if run.offload.params and pipelined:
        raise config_lib.ConfigError(
            f"[offload] params = true with pipe={pipe}: a pipeline stage holds only "
            "its own layers, so parameter offload is not supported with pipelining; use pipe=1 "
            "(fsdp over the same devices), or --offload-optimizer alone")
    schedule = run.parallel.pipeline_schedule
    if run.precision.policy == "fp8" and pipelined and schedule in schedule_lib.SPLIT_BACKWARD:
        raise config_lib.ConfigError(
            f"--precision fp8 with --pipeline-schedule {schedule}: a split backward computes "
            "each weight's gradient apart from its product, where the FP8 product's rounded "
            "operands are not kept; use --pipeline-schedule 1f1b or interleaved")


def check_experts(model: ModelFns, sizes: dict[str, int], grad_reduce: str) -> None:
    """An `expert` axis needs a mixture of experts whose experts it divides;
    a mixture of experts reduces its gradients once per microbatch
    (grads.unreduced_axes)."""
    if model.experts and grad_reduce == "step":
        raise config_lib.ConfigError(
            "--grad-reduce step with a mixture of experts: its dispatch runs per device over "
            "every axis that splits the batch, which per-device partial sums would split; use "
            "--grad-reduce microbatch (or auto)")
    ep = sizes.get("expert", 1)
    if ep == 1:
        return
    if not model.experts:
        raise config_lib.ConfigError(
            f"mesh axis expert={ep} on a dense model: it splits a mixture of experts' experts, "
            "and this model has none; put those devices on data or fsdp, or choose a mixture "
            "of experts (moe-tiny, mixtral-8x7b, qwen3-30b-a3b)")
    if model.experts % ep:
        raise config_lib.ConfigError(
            f"the model's {model.experts} experts do not split over expert={ep}; choose an "
            f"expert axis that divides {model.experts} (the rest of the devices on data or "
            "fsdp)")


def resolve_grad_reduce(choice: str, zero_stage: int) -> str:
    """When accumulated gradients are reduced: "step" (once per optimizer step,
    from per-device partial sums) or "microbatch" (each microbatch's, into the
    gradient layout). "auto": once per step, except at ZeRO-3, where reducing
    each microbatch is what keeps the accumulator at 1/N of the gradients."""
    if choice == "auto":
        return "microbatch" if zero_lib.stage(zero_stage).params else "step"
    return choice


def check_grad_reduce(choice: str, zero_stage: int) -> None:
    if choice == "microbatch" and not zero_lib.stage(zero_stage).grads:
        raise config_lib.ConfigError(
            f"--grad-reduce microbatch with --zero-stage {zero_stage}: gradients are replicated "
            "at stages 0 and 1, so the accumulator is full-size either way and reducing every "
            "microbatch only multiplies the traffic; use --grad-reduce step (or auto), or "
            "--zero-stage 2 or 3 to keep the accumulator sharded")
