"""DeepSeek-V3 in Hugging Face's layout (`DeepseekV3ForCausalLM`, model_type
"deepseek_v3"; Kimi-K2's files are the same architecture): config.json and
the names and shapes of the attention and MLP tensors, which differ from
the rest of the Llama family's (models/llama/hf.py, which delegates here).

Latent attention's projections are torch Linear weights (out, in):
q_a_proj (Cq, D), q_b_proj (H Q, Cq), kv_a_proj_with_mqa (C + R, D),
kv_b_proj (H (N + V), C), o_proj (D, H V); ours are their transposes, split
by head. DeepSeek lays each head's R rotated dimensions out in interleaved
pairs (`rope_interleave`, transformers' default for the class); ours are
in the half-rotation layout, so those rows are permuted (evens, then odds)
on the way in and back on the way out: the same products, as rotating the
permuted pairs is rotating the pairs. The first `first_k_dense_replace`
layers have a dense MLP (our "dense_blocks" stack); the others a router
(mlp.gate.weight, with e_score_correction_bias: our expert_bias), the
experts one by one and the shared experts as one MLP.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import numpy as np

from models.common.hf_files import Piece, Read, expert_pieces
from models.llama.config import LlamaConfig

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
# A routed expert's (gate, up, down) in layer i, as torch Linear weights.
EXPERTS = ("mlp.gate.weight", ("mlp.experts.{j}.gate_proj.weight",
                               "mlp.experts.{j}.up_proj.weight",
                               "mlp.experts.{j}.down_proj.weight"))
# An MTP module's own vectors beside its block: (ours under mtp_k, theirs in its layer).
MTP_NORMS = (("enorm.scale", "enorm.weight"), ("hnorm.scale", "hnorm.weight"),
             ("norm.scale", "shared_head.norm.weight"))


def shape_from(hf: dict, where: str = "config.json") -> dict:
    """LlamaConfig fields from a DeepseekV3ForCausalLM config.json, read as
    transformers 5's class reads it (sigmoid scores with the correction
    bias, whatever `scoring_func`/`topk_method` say: the class has no
    other); a key it honours that this model cannot compute is refused."""
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"{where}: hidden_act = {hf['hidden_act']!r} is not supported: the "
                         "MLP here is SwiGLU, whose gate is silu")
    if hf.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias = True is not supported: this model's "
                         "latent attention has no biases")
    heads = hf["num_attention_heads"]
    fields = {
        "family": MODEL_TYPE, "n_layer": hf["num_hidden_layers"], "n_head": heads,
        "n_kv_head": heads, "d_model": hf["hidden_size"], "d_mlp": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"], "max_seq_len": hf["max_position_embeddings"],
        "rms_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "n_experts": hf["n_routed_experts"], "n_experts_per_tok": hf["num_experts_per_tok"],
        "d_expert": hf["moe_intermediate_size"], "n_shared_experts": hf.get("n_shared_experts") or 0,
        "score_func": "sigmoid", "expert_bias": True,
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "n_group": hf.get("n_group") or 1, "topk_group": hf.get("topk_group") or 1,
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "first_k_dense_replace": hf.get("first_k_dense_replace", 0),
        "q_lora_rank": hf.get("q_lora_rank") or 0, "kv_lora_rank": hf["kv_lora_rank"],
        "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": hf["qk_rope_head_dim"],
        "v_head_dim": hf["v_head_dim"], **_rope(hf, where),
    }
    if fields["d_expert"] == fields["d_mlp"]:
        fields.pop("d_expert")
    return fields


def _rope(hf: dict, where: str) -> dict:
    """rope_theta and, for rope_type "yarn", rope_yarn, from
    `rope_parameters` (transformers 5) or `rope_scaling` (DeepSeek's files)."""
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    out = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return out
    if kind != "yarn" or "attention_factor" in rope or rope.get("truncate", True) is False:
        raise ValueError(f"{where}: rope {kind!r} ({', '.join(sorted(rope))}) is not supported: "
                         "the default rotation and YaRN with its computed attention factor are")
    original = rope.get("original_max_position_embeddings") or hf["max_position_embeddings"]
    out["rope_yarn"] = (float(rope["factor"]), int(original), float(rope.get("beta_fast") or 32),
                        float(rope.get("beta_slow") or 1), float(rope.get("mscale") or 0),
                        float(rope.get("mscale_all_dim") or 0))
    return out


def config_json(cfg: LlamaConfig) -> dict:
    """config.json for `cfg` as DeepseekV3ForCausalLM, every key its class
    reads stated; num_nextn_predict_layers counts the MTP modules written
    (transformers ignores it; DeepSeek's and vLLM's loaders read them)."""
    out = {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_mlp, "moe_intermediate_size": cfg.expert_mlp,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_head, "n_routed_experts": cfg.n_experts,
        "n_shared_experts": cfg.n_shared_experts, "num_experts_per_tok": cfg.n_experts_per_tok,
        "routed_scaling_factor": cfg.routed_scaling_factor, "n_group": cfg.n_group,
        "topk_group": cfg.topk_group, "norm_topk_prob": cfg.norm_topk_prob,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "head_dim": cfg.qk_rope_head_dim,
        "rope_interleave": True, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "num_nextn_predict_layers": cfg.mtp_depth, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_yarn:
        factor, original, fast, slow, mscale, mscale_all_dim = cfg.rope_yarn
        rope.update(rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                    beta_fast=fast, beta_slow=slow, mscale=mscale or None,
                    mscale_all_dim=mscale_all_dim or None)
    out["rope_parameters"] = rope
    return out


def _interleaved(R: int) -> np.ndarray:
    """Our rotated dimension r is DeepSeek's row order[r] (evens, then odds)."""
    return np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])


def attention_map(cfg: LlamaConfig) -> dict[str, tuple[str, Callable, Callable, tuple]]:
    """Our stacked path (without its stack) -> (Hugging Face name in layer i,
    to ours, to theirs, their shape) for latent attention."""
    D, H, N, R, V = cfg.d_model, cfg.n_head, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, \
        cfg.v_head_dim
    C, Cq, Q = cfg.kv_lora_rank, cfg.q_lora_rank, N + R
    order = _interleaved(R)
    inverse = np.argsort(order)
    q_rows = np.concatenate([np.arange(N), N + order])  # per head: ours <- theirs
    q_back = np.concatenate([np.arange(N), N + inverse])
    kv_rows = np.concatenate([np.arange(C), C + order])
    kv_back = np.concatenate([np.arange(C), C + inverse])

    def q_proj(width):  # (H Q, width) -> (width, H, Q), rotated rows de-interleaved
        return (lambda w: w.reshape(H, Q, width)[:, q_rows].transpose(2, 0, 1),
                lambda w: w[:, :, q_back].transpose(1, 2, 0).reshape(H * Q, width), (H * Q, width))

    def same(shape):
        return (lambda x: x, lambda x: x, shape)
    out = {
        "w_kv_a": ("self_attn.kv_a_proj_with_mqa.weight", lambda w: w[kv_rows].T,
                   lambda w: w.T[kv_back], (C + R, D)),
        "kv_a_norm": ("self_attn.kv_a_layernorm.weight", *same((C,))),
        "w_kv_b": ("self_attn.kv_b_proj.weight", lambda w: w.T.reshape(C, H, N + V),
                   lambda w: w.reshape(C, H * (N + V)).T, (H * (N + V), C)),
        "w_o": ("self_attn.o_proj.weight", lambda w: w.T.reshape(H, V, D),
                lambda w: w.reshape(H * V, D).T, (D, H * V)),
    }
    if Cq:
        out.update({
            "w_q_a": ("self_attn.q_a_proj.weight", lambda w: w.T, lambda w: w.T, (Cq, D)),
            "q_a_norm": ("self_attn.q_a_layernorm.weight", *same((Cq,))),
            "w_q_b": ("self_attn.q_b_proj.weight", *q_proj(Cq)),
        })
    else:
        out["w_q"] = ("self_attn.q_proj.weight", *q_proj(D))
    return out


def mlp_map(cfg: LlamaConfig, dense: bool) -> dict[str, tuple[str, Callable, Callable, tuple]]:
    """As `attention_map`, for a dense layer's MLP or a mixture's router,
    selection bias and shared experts (the routed experts are read one by
    one: EXPERTS)."""
    D, E = cfg.d_model, cfg.n_experts

    def linear(name, shape):
        return (name, lambda w: w.T, lambda w: w.T, shape)
    if dense:
        F = cfg.d_mlp
        return {"w_gate": linear("mlp.gate_proj.weight", (F, D)),
                "w_up": linear("mlp.up_proj.weight", (F, D)),
                "w_down": linear("mlp.down_proj.weight", (D, F))}
    S = cfg.shared_mlp
    out = {"moe.w_router": linear(EXPERTS[0], (E, D)),
           "moe.expert_bias": ("mlp.gate.e_score_correction_bias", lambda b: b, lambda b: b, (E,))}
    if cfg.n_shared_experts:
        out.update({"moe.w_shared_gate": linear("mlp.shared_experts.gate_proj.weight", (S, D)),
                    "moe.w_shared_up": linear("mlp.shared_experts.up_proj.weight", (S, D)),
                    "moe.w_shared_down": linear("mlp.shared_experts.down_proj.weight", (D, S))})
    return out


def stacks(cfg: LlamaConfig) -> list[tuple[int, int, dict]]:
    """(layers, the Hugging Face layer of the first, {our stacked path: its
    entry}) of each of our stacks in layer order: the dense layers before
    the mixtures are a stack of their own ("dense_blocks")."""
    D, k = cfg.d_model, cfg.first_k_dense_replace
    norms = {"attn_norm.scale": ("input_layernorm.weight", lambda x: x, lambda x: x, (D,)),
             "mlp_norm.scale": ("post_attention_layernorm.weight", lambda x: x, lambda x: x, (D,))}

    def stack(prefix, dense):
        both = {**norms, **attention_map(cfg), **mlp_map(cfg, dense)}
        return {f"{prefix}.{name}": entry for name, entry in both.items()}
    dense = [(k, 0, stack("dense_blocks", True))] if k else []
    return dense + [(cfg.n_layer - k, k, stack("blocks", False))]


def mtp_sources(cfg: LlamaConfig, get: Callable) -> dict[str, Callable]:
    """Our MTP modules' parameters from DeepSeek's files, where module k is
    layer n_layer + k (its block's tensors named as a mixture layer's, with
    enorm, hnorm, eh_proj and shared_head.norm beside them; the copies of
    the embedding and head it also stores are not read: ours are shared).
    transformers neither reads nor writes that layer: a directory it saved
    has none, and is refused here naming --mtp-depth 0."""
    (_, _, layer_map), = stacks(dataclasses.replace(cfg, first_k_dense_replace=0))

    def read(name):
        def build(tensors, _):
            try:
                return get(tensors, name)
            except KeyError:
                raise ValueError(f"{name} is not in the weights: the model has "
                                 f"{cfg.mtp_depth} multi-token prediction module(s), which a "
                                 "directory transformers saved does not hold; use --mtp-depth 0, "
                                 "or DeepSeek's own files") from None
        return build

    out = {}
    for k in range(cfg.mtp_depth):
        at, ours = f"model.layers.{cfg.n_layer + k}", f"mtp_{k}"
        for name, theirs in MTP_NORMS:
            out[f"{ours}.{name}"] = read(f"{at}.{theirs}")
        eh = read(f"{at}.eh_proj.weight")
        out[f"{ours}.w_eh"] = lambda tensors, i, eh=eh: np.ascontiguousarray(eh(tensors, i).T)
        for path, (theirs, to_ours, _, _) in layer_map.items():
            one = read(f"{at}.{theirs}")
            out[f"{ours}.block.{path[len('blocks.'):]}"] = (
                lambda tensors, i, one=one, to_ours=to_ours:
                np.ascontiguousarray(to_ours(one(tensors, i))))
        for path, theirs in zip(("w_experts_gate", "w_experts_up", "w_experts_down"), EXPERTS[1]):
            experts = [read(f"{at}.{theirs.format(j=j)}") for j in range(cfg.n_experts)]
            out[f"{ours}.block.moe.{path}"] = (lambda tensors, i, experts=experts: np.stack(
                [e(tensors, i).T for e in experts]))
    return out


def mtp_pieces(cfg: LlamaConfig, read: Read) -> Iterator[Piece]:
    """The MTP modules as DeepSeek's files hold them, `mtp_sources`'
    mirror: module k as layer n_layer + k, with copies of the embedding and
    the head (shared_head.head), which its loaders read from that layer."""
    (_, _, layer_map), = stacks(dataclasses.replace(cfg, first_k_dense_replace=0))
    V, D, F = cfg.vocab_size, cfg.d_model, cfg.expert_mlp
    head = "wte" if cfg.tie_embeddings else "w_head"
    for k in range(cfg.mtp_depth):
        at, ours = f"model.layers.{cfg.n_layer + k}", f"mtp_{k}"
        yield f"{at}.embed_tokens.weight", (V, D), lambda: read("wte", None)[:V]
        for name, theirs in MTP_NORMS:
            yield f"{at}.{theirs}", (D,), lambda path=f"{ours}.{name}": read(path, None)
        yield (f"{at}.eh_proj.weight", (D, 2 * D),
               lambda path=f"{ours}.w_eh": np.ascontiguousarray(read(path, None).T))
        for path, (theirs, _, to_theirs, shape) in layer_map.items():
            yield (f"{at}.{theirs}", shape, lambda path=f"{ours}.block.{path[len('blocks.'):]}",
                   to_theirs=to_theirs: to_theirs(read(path, None)))
        yield from expert_pieces(read, [f"{ours}.block.moe.w_experts_{m}" for m in
                                        ("gate", "up", "down")], EXPERTS[1], None, at,
                                 ((F, D), (F, D), (D, F)), cfg.n_experts)
        yield f"{at}.shared_head.head.weight", (V, D), lambda: read(head, None)[:V]
