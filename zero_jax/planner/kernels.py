"""How long one device's kernels take in a layer, from their shapes.

A matrix product (GEMM) of an M x K by a K x N matrix takes the longer of
its compute and its memory traffic (a roofline):

  compute  2 M N K FLOPs at the device's peak for the dtype, times the
           fraction of peak a large, well-shaped GEMM sustains there (the
           measured "maximum achievable matmul FLOPS" of the device TOML),
           on whole tiles in whole waves: the output is cut into tiles of
           the TOML's shapes, each compute unit (SM) runs one tile at a
           time, and a last, partial wave costs a whole one. Of the TOML's
           tile shapes, the fastest is taken, as cuBLAS's heuristics pick.
  memory   M K + K N + M N elements read or written at the HBM bandwidth
           times the fraction of it a streaming kernel reaches.

Work without products (norms, activations, softmax, residual adds) moves
bytes: its inputs read and its output written forward; the output's
gradient and what its backward needs read, its inputs' gradients written
backward. Attention is either XLA's (the scores written out: two batched
GEMMs per head and a softmax over H x T elements per token) or cuDNN's
fused flash kernel (the causal half of the score products, forward and
2.5 times that backward, at the TOML's flash efficiency; nothing of T x T
size touches HBM).

Each kernel adds the device's launch gap, and the sum is divided by the
step efficiency: the fraction of its kernels' time a real step reaches
(gaps between kernels, work this model does not list, clocks below their
peak). That one figure per device kind is fitted to the published runs
(docs/planning.md#published-runs); every other figure is cited, or
marked assumed, beside it in the TOML.
"""

from __future__ import annotations

import dataclasses
import math

from zero_jax import job as job_lib
from zero_jax.model.contract import Op
from zero_jax.planner.choices import Choice
from zero_jax.planner.step_bytes import dtype_bytes, update_elements
from zero_jax.runtime.device_kinds import Device
from zero_jax.sharding import zero as zero_lib

ATTENTION_OPS = ("scores", "ctx")  # the block's products without weights (block.ops)
FUSED = ("scores", "probs", "ctx")  # what cuDNN's flash kernel computes in one
FLASH_BACKWARD = 2.5  # flash attention's backward FLOPs over its forward's (Dao 2023, sec. 3.1)
LOGIT_BYTES = 4  # the loss reads and writes float32 logits


@dataclasses.dataclass(frozen=True)
class Gemm:
    """`batch` products of an m x k by a k x n matrix."""

    m: float
    n: float
    k: float
    batch: float = 1

    @property
    def flops(self) -> float:
        return 2 * self.batch * self.m * self.n * self.k

    def transposes(self) -> tuple[Gemm, Gemm]:
        """The backward's two products: the input's gradient (m x n by
        n x k) and the weight's (k x m by m x n)."""
        return (Gemm(self.m, self.k, self.n, self.batch), Gemm(self.k, self.n, self.m, self.batch))


@dataclasses.dataclass(frozen=True)
class LayerTimes:
    """Seconds on one device, per microbatch (the update: per step)."""

    forward: float  # one layer's forward
    backward: float  # its backward proper (nothing recomputed)
    weight: float  # of `backward`, the weights' gradient products
    head_forward: float  # the head (output product, loss)
    head_backward: float
    update: float  # the optimizer's update of this device's shard, once per step


def peak(device: Device, itemsize: int) -> float:
    """Dense matmul FLOP/s for 16-bit operands, or float32 as JAX runs it."""
    return device.peak_flops if itemsize <= 2 else (device.peak_flops_fp32 or device.peak_flops)


def gemm_s(g: Gemm, itemsize: int, device: Device) -> float:
    """One GEMM's seconds: the roofline on the fastest tile shape, or the
    rate measured for the nearest swept shape, plus a launch."""
    measured = [p for p in device.gemm_sweep if p[3] == itemsize]
    if measured:
        *_, rate = min(measured, key=lambda p: sum(
            abs(math.log(a / b)) for a, b in zip(p[:3], (g.m, g.n, g.k))))
        return g.flops / rate + device.launch_s
    units = device.compute_units
    unit_rate = peak(device, itemsize) * device.gemm_efficiency / units
    compute = min(math.ceil(g.batch * math.ceil(g.m / tm) * math.ceil(g.n / tn) / units)
                  * 2 * tm * tn * g.k / (unit_rate * eff)
                  for tm, tn, eff in device.gemm_tiles)
    memory = g.batch * (g.m * g.k + g.k * g.n + g.m * g.n) * itemsize / _stream(device)
    return max(compute, memory) + device.launch_s


def bytes_s(nbytes: float, device: Device) -> float:
    """One kernel streaming `nbytes` through HBM, plus a launch."""
    return nbytes / _stream(device) + device.launch_s


def flash_s(flops: float, device: Device) -> float:
    """One fused attention kernel doing `flops` (the causal half counted)."""
    return flops / (peak(device, 2) * device.flash_efficiency) + device.launch_s


def _stream(device: Device) -> float:
    return device.hbm_bw * device.hbm_efficiency


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What one device holds of a microbatch, and how its tensors split."""

    rows: float  # tokens of the microbatch on this device (its block of each row)
    seqs: float  # sequences
    seq: float  # tokens of each sequence on this device (queries)
    keys: float  # tokens each query attends over (the whole sequence)
    tensor: int
    sequence_parallel: bool
    itemsize: int
    heads: int  # query heads, whole
    widths: dict[str, int]  # elements per token of each tensor of the block
    splits: dict[str, str]  # how tensor parallelism divides each (Op.split)

    def elements(self, key: str) -> float:
        """Elements of tensor `key` on this device."""
        split = self.splits[key]
        parts = self.tensor if split or self.sequence_parallel else 1
        return self.rows * self.widths[key] / parts


def layer_times(job: job_lib.Job, choice: Choice, device: Device, attention: str) -> LayerTimes:
    """Kernel seconds of one layer and of the head of `job` under `choice`,
    with `attention` "xla" or "cudnn" (job.attention_implementation)."""
    cfg, T = job.model.config, job.run.data.seq_len
    itemsize, _ = dtype_bytes(job)
    ops = job.model.block_ops(T)
    shape = _Shape(choice.micro * T / choice.context, choice.micro, T / choice.context, T,
                   choice.tensor, job.sequence_parallel, itemsize, cfg.n_head,
                   {"x": cfg.d_model, **{op.key: op.width for op in ops}},
                   {"x": "", **{op.key: op.split for op in ops}})
    forward = backward = weight = 0.0
    if attention == "cudnn":  # one fused kernel for scores, softmax and context
        causal = sum(op.flops for op in ops if op.key in ATTENTION_OPS) * shape.rows / 2
        forward += flash_s(causal / shape.tensor, device)
        backward += flash_s(FLASH_BACKWARD * causal / shape.tensor, device)
        ops = [op for op in ops if op.key not in FUSED]
    frozen = job.model.lora is not None  # LoRA: no weight gradient of the base's products
    for op in ops:
        f, b, w = _op_times(op, shape, device)
        if frozen:
            b, w = b - w, 0.0
        forward, backward, weight = forward + f, backward + b, weight + w
    head_f, head_b = _head(job, shape, device, frozen)
    eff = device.step_efficiency
    return LayerTimes(forward / eff, backward / eff, weight / eff, head_f / eff, head_b / eff,
                      _update_s(job, choice, device) / eff)


def _op_times(op: Op, s: _Shape, device: Device) -> tuple[float, float, float]:
    """Forward, backward and weight-gradient seconds of one of the block's ops."""
    if op.dot:
        g = _gemm(op, s)
        dx, dw = g.transposes()
        w = 0.0 if op.key in ATTENTION_OPS else gemm_s(dw, s.itemsize, device)
        return (gemm_s(g, s.itemsize, device),
                gemm_s(dx, s.itemsize, device) + gemm_s(dw, s.itemsize, device), w)
    inputs = sum(map(s.elements, op.inputs))
    forward = (inputs + s.elements(op.key)) * s.itemsize
    backward = (s.elements(op.key) + sum(map(s.elements, op.backward_reads())) + inputs) * s.itemsize
    return bytes_s(forward, device), bytes_s(backward, device), 0.0


def _gemm(op: Op, s: _Shape) -> Gemm:
    """The product `op` computes on this device for its microbatch."""
    if op.key in ATTENTION_OPS:  # per sequence and head: scores T x Q by Q x T, ctx T x T by T x Q
        heads = s.heads / s.tensor
        n = op.width / s.heads if op.key == "ctx" else s.keys
        k = op.flops / (2 * op.width)
        return Gemm(s.seq, n, k, s.seqs * heads)
    n, k = op.width, op.flops / (2 * op.width)
    if op.split == "out":
        n /= s.tensor
    elif op.split == "in":
        k /= s.tensor
    return Gemm(s.rows, n, k)


def _head(job: job_lib.Job, s: _Shape, device: Device, frozen: bool) -> tuple[float, float]:
    """The output product (vocabulary split over tensor) and the loss over
    its float32 logits, forward and backward (`frozen`: the input's
    gradient only)."""
    cfg = job.model.config
    vocab = getattr(cfg, "padded_vocab", None) or job.model.vocab_size
    g = Gemm(s.rows, vocab / s.tensor, cfg.d_model)
    logits = s.rows * vocab / s.tensor * LOGIT_BYTES
    forward = gemm_s(g, s.itemsize, device) + bytes_s(2 * logits, device)
    backward = sum(gemm_s(t, s.itemsize, device) for t in g.transposes()[:1 if frozen else 2]
                   ) + bytes_s(2 * logits, device)
    return forward, backward


def _update_s(job: job_lib.Job, choice: Choice, device: Device) -> float:
    """The update streams, per parameter it updates, the float32 master and
    two moments (read and written) and the gradient and the working
    parameter (read, written)."""
    if job.state_plan.host_opt:
        return 0.0  # on the host (step_time's host update)
    c, g = dtype_bytes(job)
    elements = update_elements(job.state_plan, zero_lib.stage(choice.zero))
    return bytes_s(elements * (2 * 12 + g + c), device)
