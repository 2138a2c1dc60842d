"""The run config's sections: frozen, typed dataclasses, one per TOML table.

A run is described by a TOML file with one table per section (`[model]`,
`[parallel]`, `[optim]`, `[data]`, `[train]`, `[offload]`, ...) and/or
command-line flags; a flag overrides the file. Each field's comment is its
flag's help (flags.py reads them). The defaults are the main job: gpt-tiny on
the standard library's source, ZeRO-3 on 8 CPU devices.

Data only, importing nothing of zero_jax: the bottom of the house, which
every layer above reads its settings from.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

# Choices of this file's own fields (the others' are their modules').
LayoutName = Literal["auto", "dp", "fsdp", "fsdp_tp", "fsdp_tp_sp"]  # sharding/rules.py PRESETS
GradReduce = Literal["auto", "step", "microbatch"]  # train/checks.py resolve_grad_reduce
PipelineTables = Literal["rows", "whole"]  # pipeline/executor.py row_tables
Attention = Literal["auto", "xla", "cudnn"]  # job.attention_implementation
ExpertGemm = Literal["auto", "tiled", "ragged_dot"]  # zero_jax/model/grouped.py
ExpertExchange = Literal["auto", "ragged", "padded"]  # zero_jax/model/exchange.py
ExpertDispatch = Literal["auto", "direct", "two-hop"]  # exchange.node_size
ContextAttention = Literal["auto", "all-gather", "ring", "ulysses"]  # zero_jax/context
DtypeOverride = Literal["", "float32", "bfloat16", "float16"]  # "": the policy's
WandbMode = Literal["online", "offline"]  # wandb.init(mode=...); offline: `wandb sync` uploads later
PlanDetail = Literal["summary", "full"]  # analysis/summary.py describe

ScheduleName = Literal["gpipe", "1f1b", "interleaved", "zb-h1"]  # pipeline/schedule.py
PresetName = Literal["auto", "fp32", "bf16", "fp16", "fp8"]  # precision/policies.py PRESETS; auto: by platform
Fp8Scaling = Literal["current", "delayed"]  # model/fp8.py SCALINGS
PolicyName = Literal["none", "full", "dots_saveable", "save_names", "offload"]  # model/remat.py
Optimizer = Literal["adamw", "sgd", "adafactor"]
Decay = Literal["cosine", "linear", "constant"]


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: Optimizer = "adamw"  # adamw | sgd (with momentum) | adafactor
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 50  # linear warm-up from 0 to lr
    decay: Decay = "cosine"  # after warm-up: cosine | linear | constant
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of lr
    weight_decay: float = 0.1  # decoupled; only where the model's decay mask says
    b1: float = 0.9  # Adam first-moment decay
    b2: float = 0.95  # Adam second-moment decay
    eps: float = 1e-8  # Adam epsilon
    momentum: float = 0.9  # SGD momentum
    clip_norm: float = 1.0  # clip gradients to this global norm; 0 turns clipping off


class ConfigError(ValueError):
    """A run config that cannot run; raised before anything is compiled."""


# The [data] source of a config the planner wrote (planner/configs.py): the
# plan knows the sequence length, not where the user's tokens are.
DATA_PLACEHOLDER = "SET ME: a directory zero-jax prepare-data wrote"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # a preset in models/ (gpt-tiny ... gpt3-175b, llama-tiny ... qwen2-7b), "hf:DIR" for a
    # Hugging Face config.json's shape, or "": none (GPT, every shape field given)
    name: str = "gpt-tiny"
    vocab_multiple: int = 1  # pad the vocabulary to a multiple (e.g. 128) so tensor divides it
    n_layer: int = 0  # transformer blocks (0: the preset's)
    n_head: int = 0  # attention heads (0: the preset's)
    d_model: int = 0  # residual width (0: the preset's)
    d_mlp: int = 0  # MLP width (0: the preset's, or 4 d_model)
    vocab_size: int = 0  # vocabulary (0: the preset's, else the data's)
    max_seq_len: int = 0  # positions (0: the preset's, or 2048)
    n_kv_head: int = 0  # Llama family: key/value heads (0: the preset's)
    head_dim: int = 0  # Llama family: head size (0: the preset's, or d_model / n_head)
    rope_theta: float = 0.0  # Llama family: rotary base (0: the preset's)
    sliding_window: int = 0  # Llama family: each query sees the last this many positions, Mistral's (0: the preset's, or all)
    tie_embeddings: bool | None = None  # Llama family: the head is the embedding (unset: the preset's)
    n_experts: int = 0  # mixture of experts: routed experts per block (0: the preset's)
    n_experts_per_tok: int = 0  # mixture of experts: experts per token, top-k (0: the preset's)
    d_expert: int = 0  # mixture of experts: each expert's MLP width (0: the preset's)
    n_shared_experts: int = 0  # mixture of experts: always-on experts of that width (0: the preset's)
    router_aux_loss_coef: float | None = None  # mixture of experts: load-balancing loss weight (unset: the preset's)
    router_z_loss_coef: float | None = None  # mixture of experts: router z-loss weight (unset: the preset's, 0)
    capacity_factor: float | None = None  # mixture of experts: > 0 caps each expert's tokens (drops); 0: dropless (unset: the preset's)
    mtp_depth: int | None = None  # multi-token prediction modules, DeepSeek-V3's (0: none; unset: the preset's)
    mtp_loss_weight: float | None = None  # their mean loss's weight in the training loss (unset: the preset's)
    n_group: int = 0  # mixture of experts, group-limited routing (DeepSeek-V3): the experts in this many groups (0: the preset's)
    topk_group: int = 0  # group-limited routing: a token's experts from its best this many groups (0: the preset's)
    routed_scaling_factor: float = 0.0  # the routed experts' weights scaled by this, DeepSeek-V3's (0: the preset's)
    first_k_dense_replace: int | None = None  # mixture of experts: the first this many layers dense, DeepSeek-V3's (unset: the preset's)
    router_bias_update_rate: float | None = None  # mixture of experts with a selection bias (DeepSeek-V3): its step per step against the load error, aux-loss-free balancing; 0: fixed (unset: the preset's)
    expert_gemm: ExpertGemm = "auto"  # mixture of experts, dropless: tiled (a loop over row tiles: the routed FLOPs on any backend) | ragged_dot (XLA's ragged-dot: a grouped GEMM where a kernel takes it, else dense); auto: tiled
    expert_exchange: ExpertExchange = "auto"  # mixture of experts, dropless, over `expert`: ragged (ragged_all_to_all: the routed copies' bytes) | padded (all_to_all of worst-case blocks); auto: ragged where the backend compiles it (GPU, TPU)
    expert_dispatch: ExpertDispatch = "auto"  # mixture of experts, dropless, an expert axis across nodes: two-hop (a token once to each node it needs, then to its experts inside the node, DeepSeek-V3's) | direct (each copy to its expert's device); auto: two-hop where the axis has several devices on each of several nodes
    attention: Attention = "auto"  # xla | cudnn (jax.nn.dot_product_attention); auto: cudnn on GPU in 16 bits
    scan_layers: bool = True  # false: unroll the layer stack (longer compiles; the compiler then sees, and counts, every layer)

    SHAPE_FIELDS = ("n_layer", "n_head", "d_model", "d_mlp", "vocab_size", "max_seq_len",
                    "n_kv_head", "head_dim", "rope_theta", "sliding_window", "tie_embeddings",
                    "n_experts",
                    "n_experts_per_tok", "d_expert", "n_shared_experts", "router_aux_loss_coef",
                    "router_z_loss_coef", "capacity_factor", "router_bias_update_rate",
                    "mtp_depth", "mtp_loss_weight", "n_group", "topk_group",
                    "routed_scaling_factor", "first_k_dense_replace")
    # Fields whose zero is a choice (no router loss, dropless, a fixed bias, no MTP),
    # not "the preset's".
    ZERO_IS_SET = ("router_aux_loss_coef", "router_z_loss_coef", "capacity_factor",
                   "router_bias_update_rate", "mtp_depth", "mtp_loss_weight",
                   "first_k_dense_replace")

    def shape(self) -> dict[str, Any]:
        """The shape fields given (non-zero, or set), to override the preset's."""
        return {f: v for f in self.SHAPE_FIELDS
                if (v := getattr(self, f)) is not None
                and (isinstance(v, bool) or v or f in self.ZERO_IS_SET)}


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    mesh: str = "cpu-8"  # a meshes/ name, a TOML path, or inline like data=2,fsdp=4
    layout: LayoutName = "auto"  # dp | fsdp | fsdp_tp | fsdp_tp_sp; auto: fsdp, or fsdp_tp with tensor > 1
    zero_stage: int | None = None  # 0 DDP, 1 optimizer state, 2 + gradients, 3 + parameters; None: the layout's
    zero_shard_axes: str = ""  # comma list narrowing the mesh's ZeRO axes ("fsdp": hybrid)
    min_shard_elements: int = 4096  # arrays smaller than this stay replicated
    pipeline_schedule: ScheduleName = "1f1b"  # gpipe | 1f1b | interleaved | zb-h1 (with a pipe axis)
    virtual_stages: int = 0  # chunks per device for interleaved (0: 2 for interleaved, else 1)
    pipeline_gather_once: bool = False  # ZeRO-3: gather a stage's weights once per step, not per microbatch
    pipeline_tables: PipelineTables = "rows"  # rows: each stage uses its row block of the embedding and head (where pipe divides them); whole: gathered, gradients summed whole
    overlap_collectives: bool = True  # XLA:GPU: each layer's ZeRO gather issued an iteration early and its gradient reduction finished an iteration late, beside the layer scan's compute (overlap.py); other backends ignore it
    grad_reduce: GradReduce = "auto"  # step | microbatch: when accumulated gradients are reduced; auto: microbatch at stage 3
    context_attention: ContextAttention = "auto"  # all-gather | ring | ulysses: attention across a context axis; auto: ulysses where the heads split over it under cuDNN attention, else ring


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    policy: PresetName = "auto"  # fp32 | bf16 | fp16 | fp8 (bf16, the blocks' projections in FP8); auto: bf16 on accelerators, fp32 on CPU
    param_dtype: DtypeOverride = ""  # override: stored (master) parameters
    compute_dtype: DtypeOverride = ""  # override: matmuls and activations
    grad_dtype: DtypeOverride = ""  # override: gradient reduction and accumulation
    opt_state_dtype: DtypeOverride = ""  # override: optimizer moments
    initial_scale_power: int = 16  # fp16 loss scale starts at 2**power
    loss_scale_window: int = 1000  # finite steps in a row before the loss scale doubles
    hysteresis: int = 2  # overflows tolerated before the loss scale halves
    min_loss_scale: float = 1.0  # the loss scale never goes below this
    max_consecutive_skips: int = 20  # stop after this many non-finite steps in a row
    fp8: Fp8Scaling = "current"  # under --precision fp8: each tensor's scale from this step's amax, or "delayed" from an amax history
    fp8_history: int = 1024  # delayed scaling: steps of amax history kept per tensor (in the train state, checkpointed)


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """ZeRO++'s quantized collectives (sharding/quantized.py)."""

    quantized_weights: bool = False  # qwZ: ZeRO-3's parameter all-gathers in int8 blocks
    quantized_grads: bool = False  # qgZ: gradient reductions in int8 blocks
    block_size: int = 256  # elements per int8 block (each with a float32 scale)


@dataclasses.dataclass(frozen=True)
class ActivationConfig:
    remat: PolicyName = "none"  # none | full | dots_saveable | save_names | offload
    save_names: str = "qkv,attn_ctx,mlp_hidden"  # named activations kept (save_names) or offloaded (offload)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # "stdlib" (byte-level Python source), a directory zero-jax prepare-data wrote, or a flat uint16 file
    seq_len: int = 128  # tokens per row fed to the model
    segment_ids: bool = False  # attend within each document only; positions restart at each


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 300  # optimizer steps (the schedule's length)
    stop_at: int = 0  # stop after this step, saving a checkpoint (0: run all steps)
    batch_size: int = 32  # global batch, in rows, per optimizer step
    microbatches: int = 1  # gradient-accumulation microbatches per step
    seed: int = 0  # parameters and data order
    eval_every: int = 100  # steps between validation passes (0: only at the end)
    eval_batches: int = 8  # validation batches per pass
    metrics_out: str = ""  # JSON-lines file of per-step metrics ("" for none)
    tensorboard_dir: str = ""  # also write the metrics as TensorBoard scalars here ("" for none)
    wandb_project: str = ""  # also log the metrics, config and plan to this W&B project ("" for none; the wandb extra)
    wandb_mode: WandbMode = "online"  # online | offline (written under $WANDB_DIR, uploaded by `wandb sync`)
    profile_steps: str = ""  # A:B: a jax.profiler trace of steps A to B - 1 ("" for none)
    profile_dir: str = ""  # where the trace goes ("": --tensorboard-dir, else ./profile)
    plan: PlanDetail = "summary"  # the plan printed before training: summary (one screen) | full (every parameter's layout, collective and pipeline tick)


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    optimizer: bool = False  # optimizer state and master weights in host memory, updated there
    params: bool = False  # ZeRO-3's stored parameter shards in host memory, fetched layer by layer


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 0  # low-rank adapters of this rank on a frozen base (0: train every parameter)
    alpha: float = 16.0  # the adapters' term is scaled by alpha / rank
    targets: str = "q,v"  # the block projections adapted: any of q,k,v,o,gate,up,down
    dropout: float = 0.0  # dropout on the adapters' input in training, as peft's lora_dropout
    # store the frozen base's block projections quantized: none, int8 (a scale per
    # output channel) or nf4 (QLoRA's 4-bit NormalFloat, a scale per block)
    quantize_base: Literal["none", "int8", "nf4"] = "none"
    base_block: int = 64  # nf4: elements per block of the base's scales
    # start the adapters from these: a peft adapter directory or a LoRA run's checkpoint
    init_from: str = ""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""  # directory of the run's checkpoints ("": none)
    every: int = 0  # save every N steps (0: only at the end and on preemption)
    keep_last: int = 3  # keep the newest K complete checkpoints
    keep_every: int = 0  # also keep every step divisible by M (0: none)
    resume: bool = False  # continue from the newest complete checkpoint in dir
    init_from: str = ""  # start from these parameters: a checkpoint dir, .safetensors, or HF dir
    async_save: bool = True  # commit in the background while training continues


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator: str = ""  # host:port of process 0 ("": the launcher's or the cluster's)
    num_processes: int = 0  # with coordinator (0: from the environment)
    process_id: int = -1  # with coordinator (-1: from the environment)
    heartbeat_timeout_s: int = 100  # a process silent this long is dead; the run ends
    barrier_timeout_s: int = 300  # start-up and every barrier give up after this
    watchdog_warn: float = 5.0  # report a step taking this many times the recent median
    watchdog_stop: float = 50.0  # stop the run past this many times (0: never)
    watchdog_min_s: float = 30.0  # never report a step shorter than this


@dataclasses.dataclass(frozen=True)
class Window:
    first: int  # first traced step (1-based, as in the metrics)
    stop: int  # first step after the trace

    @classmethod
    def parse(cls, text: str) -> "Window | None":
        """"A:B" -> the window; "" -> None. Raises ValueError naming the flag."""
        if not text:
            return None
        try:
            a, b = (int(part) for part in text.split(":"))
        except ValueError:
            raise ValueError(f"--profile-steps {text!r}: expected A:B, two step numbers, e.g. "
                             "5:8 traces steps 5, 6 and 7") from None
        if not 1 <= a < b:
            raise ValueError(f"--profile-steps {text}: need 1 <= A < B (A:B traces steps A to "
                             "B - 1, numbered from 1 as in the metrics file)")
        return cls(a, b)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    zero: ZeroConfig = ZeroConfig()
    precision: PrecisionConfig = PrecisionConfig()
    activations: ActivationConfig = ActivationConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    offload: OffloadConfig = OffloadConfig()
    lora: LoraConfig = LoraConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    distributed: DistributedConfig = DistributedConfig()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# TOML table -> its dataclass, in the order --help lists them.
SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "zero": ZeroConfig,
            "precision": PrecisionConfig,
            "activations": ActivationConfig, "optim": OptimConfig, "data": DataConfig,
            "train": TrainConfig, "offload": OffloadConfig, "lora": LoraConfig,
            "checkpoint": CheckpointConfig,
            "distributed": DistributedConfig}
