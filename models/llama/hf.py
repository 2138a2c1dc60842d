"""The Llama family in Hugging Face's layout (LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM, and the mixtures of experts
MixtralForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM): names,
shapes and config.json.

Hugging Face stores each layer separately, every projection a torch Linear
weight of shape (out, in): q_proj is (H Q, D), our (D, H, Q) transposed
and split by head; o_proj (D, H Q) is our (H, Q, D); gate, up and down are
our (D, F), (D, F) and (F, D) transposed. Rotary embeddings use the same
half-rotation layout, so the head dimensions map one to one. A mixture of
experts stores each expert's three matrices separately (Mixtral's w1, w3,
w2 are gate, up and down), and its router as a (E, D) Linear; ours are
stacked, (E, D, F), and (D, E).
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from models.common.hf_files import Get, Read, expert_pieces, padded_rows
from models.llama import deepseek_hf
from models.llama.config import LlamaConfig

MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v3": deepseek_hf.ARCHITECTURE}
# Whether each family's q, k and v projections have biases: "always" (Qwen2),
# "flag" (Qwen2-MoE's `qkv_bias`, default true), or "never" (Mistral and
# Mixtral whatever `attention_bias` says; Llama's and Qwen3-MoE's
# `attention_bias` would bias o_proj too, which this model does not have).
QKV_BIAS = {"llama": "never", "mistral": "never", "qwen2": "always", "mixtral": "never",
            "qwen2_moe": "flag", "qwen3_moe": "never", "deepseek_v3": "never"}
# A mixture of experts' tensors in layer i: the router, and expert j's
# (gate, up, down) matrices, as torch Linear weights (out, in).
EXPERTS = {"mixtral": ("block_sparse_moe.gate.weight",
                       ("block_sparse_moe.experts.{j}.w1.weight",
                        "block_sparse_moe.experts.{j}.w3.weight",
                        "block_sparse_moe.experts.{j}.w2.weight")),
           "qwen3_moe": ("mlp.gate.weight",
                         ("mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight",
                          "mlp.experts.{j}.down_proj.weight"))}
EXPERTS["qwen2_moe"] = EXPERTS["qwen3_moe"]
EXPERTS["deepseek_v3"] = deepseek_hf.EXPERTS
STACKED = ("blocks.moe.w_experts_gate", "blocks.moe.w_experts_up", "blocks.moe.w_experts_down")


def shape_from(hf: dict, where: str = "config.json") -> dict:
    """Our LlamaConfig fields from a Hugging Face config.json, read as
    transformers' class for its model_type reads it (transformers 5): a key
    that class honours and this model cannot compute is refused in one line
    naming it; one the class ignores (a Llama's sliding_window, a Mistral's
    attention_bias) is ignored here too. docs/models.md has the table."""
    kind = hf["model_type"]
    if kind == deepseek_hf.MODEL_TYPE:
        return deepseek_hf.shape_from(hf, where)
    heads = hf["num_attention_heads"]
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"{where}: hidden_act = {hf['hidden_act']!r} is not supported: the "
                         "MLP here is SwiGLU, whose gate is silu")
    fields = {
        "family": kind, "n_layer": hf["num_hidden_layers"], "n_head": heads,
        "n_kv_head": hf.get("num_key_value_heads") or heads, "d_model": hf["hidden_size"],
        "d_mlp": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
        "max_seq_len": hf["max_position_embeddings"],
        "rms_eps": float(hf.get("rms_norm_eps", 1e-5 if kind == "mixtral" else 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": _qkv_bias(hf, kind, where),
        **_rope(hf, kind, where),
    }
    head_dim = hf.get("head_dim")  # every family's attention takes it where given
    if head_dim and head_dim != hf["hidden_size"] // heads:
        fields["head_dim"] = head_dim
    window = _window(hf, kind, where)
    if window:
        fields["sliding_window"] = window
    if kind == "llama" and hf.get("mlp_bias"):  # the one family whose MLP can have biases
        raise ValueError(f"{where}: mlp_bias = True is not supported: this model's MLP has no "
                         "biases")
    if kind == "mixtral":
        fields.update(n_experts=hf["num_local_experts"], n_experts_per_tok=hf["num_experts_per_tok"],
                      router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))
    if kind in ("qwen2_moe", "qwen3_moe"):
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"{where}: dense layers among the experts' (mlp_only_layers, "
                             "decoder_sparse_step != 1) are not supported: every layer here is "
                             "a mixture of experts")
        # Published configs say num_experts; transformers 5 writes num_local_experts.
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        fields.update(n_experts=experts, n_experts_per_tok=hf["num_experts_per_tok"],
                      d_expert=hf["moe_intermediate_size"], qk_norm=kind == "qwen3_moe",
                      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                      router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))
        if kind == "qwen2_moe":  # one shared expert of its own width, sigmoid-gated
            fields.update(n_shared_experts=1, shared_expert_gate=True,
                          d_shared=hf["shared_expert_intermediate_size"])
        if fields["d_expert"] == fields["d_mlp"]:
            fields.pop("d_expert")
    return fields


def _qkv_bias(hf: dict, kind: str, where: str) -> bool:
    """Whether q, k and v have biases, by the family's rule (QKV_BIAS);
    an `attention_bias` that would bias o_proj too is refused."""
    rule = QKV_BIAS[kind]
    if rule != "never":
        return rule == "always" or bool(hf.get("qkv_bias", True))
    if kind in ("llama", "qwen3_moe") and hf.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias = True is not supported: it gives "
                         f"{ARCHITECTURES[kind]} an o_proj bias beside the q/k/v ones, and this "
                         "model has no o_proj bias")
    return False


def _rope(hf: dict, kind: str, where: str) -> dict:
    """rope_theta and rope_scaling, as transformers 5 reads them: it writes
    one `rope_parameters` table, older files have `rope_theta` and
    `rope_scaling`, and where a file has both tables `rope_scaling` is the
    one read. A file without a base has its class's: 1e6 for Mixtral, else
    1e4; a top-level original_max_position_embeddings wins over the table's."""
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if {"full_attention", "sliding_attention"} & set(rope):
        raise ValueError(f"{where}: rope_parameters given per layer type ({', '.join(rope)}) "
                         "are not supported: every layer here rotates alike")
    theta = rope.get("rope_theta", hf.get("rope_theta", 1e6 if kind == "mixtral" else 1e4))
    out = {"rope_theta": float(theta)}
    kind_of = rope.get("rope_type", rope.get("type", "default"))
    if kind_of == "default":  # whose frequencies transformers computes over the whole head
        return out
    if kind_of != "llama3":
        raise ValueError(f"{where}: rope_type = {kind_of!r} is not supported: only the default "
                         "rotation and Llama 3's 'llama3' scaling are")
    partial = rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor = {partial} is not supported: every "
                         "dimension of a head is rotated here")
    original = hf.get("original_max_position_embeddings") or rope.get(
        "original_max_position_embeddings") or hf["max_position_embeddings"]
    out["rope_scaling"] = (float(rope["factor"]), float(rope["low_freq_factor"]),
                           float(rope["high_freq_factor"]), int(original))
    return out


def _window(hf: dict, kind: str, where: str) -> int:
    """The sliding window every layer has (0: none), from the window each
    layer has in transformers' class (`layer_windows`); a window on some
    layers only is refused, naming the keys that placed it."""
    windows = layer_windows(hf, kind, where)
    if len(set(windows)) == 1:
        return windows[0] or 0
    some = [i for i, w in enumerate(windows) if w]
    keys = [f"{k} = {hf[k]}" for k in ("use_sliding_window", "sliding_window", "max_window_layers")
            if k in hf] + (["layer_types"] if "layer_types" in hf else [])
    raise ValueError(f"{where}: sliding_attention on layers {some} of {len(windows)} only "
                     f"({', '.join(keys)}) is not supported: every layer here attends alike, all "
                     "with one window or all without")


def layer_windows(hf: dict, kind: str, where: str = "config.json") -> list[int | None]:
    """Each layer's sliding window (None: none) as transformers 5 reads
    config.json for `kind`: Llama has none, whatever the file says; Mistral
    and Mixtral apply `sliding_window` to every layer whenever it is set
    (a Mistral file without the key gets 4096); Qwen3-MoE when
    `use_sliding_window` is true; Qwen2 and Qwen2-MoE on the layers
    `layer_types` names "sliding_attention", or without it, Qwen2 on layers
    from `max_window_layers` on, Qwen2-MoE on every other layer below it."""
    L = hf["num_hidden_layers"]
    if kind == "llama":
        return [None] * L
    window = hf.get("sliding_window", None if kind == "mixtral" else 4096)
    if kind not in ("mistral", "mixtral") and not hf.get("use_sliding_window", False):
        window = None  # the Qwen families' window acts only with the flag (their files may say 0)
    if window is not None and window <= 0:
        raise ValueError(f"{where}: sliding_window = {window} is not supported: such a window "
                         "hides every position; null means none")
    if kind in ("mistral", "mixtral", "qwen3_moe"):
        return [window] * L
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", 28)
        slides = ((lambda i: i >= first) if kind == "qwen2"
                  else (lambda i: i % 2 == 0 and i < first))
        types = ["sliding_attention" if window is not None and slides(i) else "full_attention"
                 for i in range(L)]
    if len(types) != L or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"{where}: layer_types = {types} is not supported: {L} entries, each "
                         "'full_attention' or 'sliding_attention', are")
    if window is None and "sliding_attention" in types:
        raise ValueError(f"{where}: layer_types names sliding_attention layers but "
                         f"use_sliding_window = {hf.get('use_sliding_window', False)} and "
                         f"sliding_window = {hf.get('sliding_window')} give them no window "
                         "(transformers cannot run it either)")
    return [window if t == "sliding_attention" else None for t in types]


def exportable(cfg: LlamaConfig) -> None:
    """Raises, naming the field, where `cfg` computes attention that its
    architecture in transformers cannot: checked before anything is written."""
    arch = ARCHITECTURES[cfg.family]
    if cfg.mla != (cfg.family == deepseek_hf.MODEL_TYPE) or (
            cfg.n_experts and (cfg.score_func == "sigmoid") != cfg.mla):
        raise ValueError(f"{cfg.family}: latent attention and sigmoid routing are "
                         f"{deepseek_hf.ARCHITECTURE}'s; {arch} has neither, so this model "
                         "cannot be exported as it")
    if cfg.sliding_window and cfg.family == "llama":
        raise ValueError(f"sliding_window = {cfg.sliding_window} cannot be exported: {arch} has "
                         "no sliding window (transformers ignores the key) and would attend to "
                         "every position; train without it, or as a Mistral")
    if cfg.mtp_depth and cfg.family != deepseek_hf.MODEL_TYPE:
        raise ValueError(f"mtp_depth = {cfg.mtp_depth} cannot be exported as {arch}, whose files "
                         "hold no multi-token prediction layer; export without --with-mtp")
    biased = {"always": True, "flag": cfg.qkv_bias, "never": False}[QKV_BIAS[cfg.family]]
    if cfg.qkv_bias != biased:
        raise ValueError(f"qkv_bias = {cfg.qkv_bias} cannot be exported as {arch}, whose q/k/v "
                         f"projections {'always' if biased else 'never'} have biases")


def config_json(cfg: LlamaConfig) -> dict:
    """config.json for `cfg`, with every key its class reads for the
    attention stated (shape_from reads them back): transformers' defaults
    differ by class and version (a Mistral without `sliding_window` has 4096)."""
    exportable(cfg)
    if cfg.family == deepseek_hf.MODEL_TYPE:
        return deepseek_hf.config_json(cfg)
    window = cfg.sliding_window or None
    out = {
        "architectures": [ARCHITECTURES[cfg.family]], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.q_dim, "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_dropout": 0.0,
    }
    if cfg.family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if cfg.family in ("mistral", "mixtral"):  # on every layer whenever set
        out["sliding_window"] = window
    if cfg.family in ("qwen2", "qwen2_moe", "qwen3_moe"):  # only with the flag
        out.update(use_sliding_window=bool(window), sliding_window=window)
    if cfg.family in ("qwen2", "qwen2_moe"):
        # Each layer named: without the list Qwen2-MoE would slide every other
        # layer. Qwen2's own rule (layers from max_window_layers on) agrees.
        out["layer_types"] = ["sliding_attention" if window else "full_attention"] * cfg.n_layer
    if cfg.family == "qwen2":
        out["max_window_layers"] = 0 if window else cfg.n_layer
    if cfg.family == "mixtral":
        out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_per_tok,
                   router_aux_loss_coef=cfg.router_aux_loss_coef)
    if cfg.family in ("qwen2_moe", "qwen3_moe"):
        out.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_per_tok,
                   moe_intermediate_size=cfg.expert_mlp, norm_topk_prob=cfg.norm_topk_prob,
                   router_aux_loss_coef=cfg.router_aux_loss_coef, decoder_sparse_step=1,
                   mlp_only_layers=[])
        out["attention_bias" if cfg.family == "qwen3_moe" else "qkv_bias"] = cfg.qkv_bias
    if cfg.family == "qwen2_moe":
        out["shared_expert_intermediate_size"] = cfg.shared_mlp
    if cfg.rope_scaling:
        factor, low, high, original = cfg.rope_scaling
        out["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                               "high_freq_factor": high,
                               "original_max_position_embeddings": original}
    return out


def _layer_map(cfg: LlamaConfig) -> dict[str, tuple[str, Callable, Callable, tuple]]:
    """Our stacked path -> (Hugging Face name in layer i, to ours, to theirs, their shape)."""
    D, H, K, Q, F = cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.q_dim, cfg.d_mlp
    def heads(n):
        return (lambda w: w.T.reshape(D, n, Q), lambda w: w.reshape(D, n * Q).T, (n * Q, D))

    def same(shape):
        return (lambda x: x, lambda x: x, shape)
    out = {
        "blocks.attn_norm.scale": ("input_layernorm.weight", *same((D,))),
        "blocks.w_q": ("self_attn.q_proj.weight", *heads(H)),
        "blocks.w_k": ("self_attn.k_proj.weight", *heads(K)),
        "blocks.w_v": ("self_attn.v_proj.weight", *heads(K)),
        "blocks.w_o": ("self_attn.o_proj.weight", lambda w: w.T.reshape(H, Q, D),
                       lambda w: w.reshape(H * Q, D).T, (D, H * Q)),
        "blocks.mlp_norm.scale": ("post_attention_layernorm.weight", *same((D,))),
    }
    if cfg.n_experts:
        router = EXPERTS[cfg.family][0]
        out["blocks.moe.w_router"] = (router, lambda w: w.T, lambda w: w.T, (cfg.n_experts, D))
        S = cfg.shared_mlp
        if cfg.family == "qwen2_moe":  # the shared expert, and its gate as a (1, D) Linear
            for ours, theirs, shape in (("gate", "gate_proj", (S, D)), ("up", "up_proj", (S, D)),
                                        ("down", "down_proj", (D, S))):
                out[f"blocks.moe.w_shared_{ours}"] = (f"mlp.shared_expert.{theirs}.weight",
                                                      lambda w: w.T, lambda w: w.T, shape)
            out["blocks.moe.w_shared_mix"] = ("mlp.shared_expert_gate.weight", lambda w: w.T,
                                              lambda w: w.T, (1, D))
    else:
        out.update({
            "blocks.w_gate": ("mlp.gate_proj.weight", lambda w: w.T, lambda w: w.T, (F, D)),
            "blocks.w_up": ("mlp.up_proj.weight", lambda w: w.T, lambda w: w.T, (F, D)),
            "blocks.w_down": ("mlp.down_proj.weight", lambda w: w.T, lambda w: w.T, (D, F)),
        })
    if cfg.qk_norm:
        out["blocks.q_norm"] = ("self_attn.q_norm.weight", *same((Q,)))
        out["blocks.k_norm"] = ("self_attn.k_norm.weight", *same((Q,)))
    if cfg.qkv_bias:
        for ours, theirs, n in (("b_q", "q_proj", H), ("b_k", "k_proj", K), ("b_v", "v_proj", K)):
            out[f"blocks.{ours}"] = (f"self_attn.{theirs}.bias", lambda b, n=n: b.reshape(n, Q),
                                     lambda b, n=n: b.reshape(n * Q), (n * Q,))
    return out


def _tables(cfg: LlamaConfig) -> dict[str, str]:
    out = {"wte": "model.embed_tokens.weight"}
    if not cfg.tie_embeddings:
        out["w_head"] = "lm_head.weight"
    return out


def _stacks(cfg: LlamaConfig) -> list[tuple[int, int, dict]]:
    """(layers, the Hugging Face layer of the first, {our stacked path: its
    _layer_map entry}) of each of our stacks, in layer order."""
    if cfg.family == deepseek_hf.MODEL_TYPE:
        return deepseek_hf.stacks(cfg)
    return [(cfg.n_layer, 0, _layer_map(cfg))]


def sources(cfg: LlamaConfig) -> dict[str, Callable[[Get, int | None], np.ndarray]]:
    """Our parameter path -> how to build it, or one layer of it, from
    Hugging Face tensors: one tensor read per call."""
    V, D = cfg.vocab_size, cfg.d_model
    def get(tensors, name):  # in the file's dtype: placing casts (checkpoint/stream.py)
        return np.asarray(tensors(name))

    def table(name):
        def build(tensors, _):
            w = get(tensors, name)
            if w.shape != (V, D):
                raise ValueError(f"{name} is {w.shape}; the model expects ({V}, {D})")
            return padded_rows(w, cfg.padded_vocab)
        return build

    out = {ours: table(theirs) for ours, theirs in _tables(cfg).items()}
    out["norm_f.scale"] = lambda tensors, _: get(tensors, "model.norm.weight")
    for _, first, layer_map in _stacks(cfg):
        for ours, (theirs, to_ours, _, _) in layer_map.items():
            out[ours] = (lambda tensors, i, theirs=theirs, to_ours=to_ours, first=first:
                         np.ascontiguousarray(to_ours(get(tensors,
                                                          f"model.layers.{i + first}.{theirs}"))))
    if cfg.n_experts:
        # One layer's stacked experts, read one expert's matrix at a time.
        first = cfg.first_k_dense_replace
        for ours, theirs in zip(STACKED, EXPERTS[cfg.family][1]):
            out[ours] = (lambda tensors, i, theirs=theirs: np.stack([
                get(tensors, f"model.layers.{i + first}.{theirs.format(j=j)}").T
                for j in range(cfg.n_experts)]))
    if cfg.mtp_depth and cfg.family == deepseek_hf.MODEL_TYPE:  # after the layers, in its files
        out.update(deepseek_hf.mtp_sources(cfg, get))
    return out


def pieces(cfg: LlamaConfig, read: Read) -> Iterator[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """(Hugging Face name, shape, producer) for every tensor, one layer at a time."""
    exportable(cfg)  # at the first tensor asked for, before any is written
    V, D = cfg.vocab_size, cfg.d_model
    yield "model.embed_tokens.weight", (V, D), lambda: read("wte", None)[:V]
    F = cfg.expert_mlp
    for count, first, layer_map in _stacks(cfg):
        experts = cfg.n_experts and any(ours.startswith("blocks.") for ours in layer_map)
        for i in range(count):
            at = f"model.layers.{i + first}"
            for ours, (theirs, _, to_theirs, shape) in layer_map.items():
                yield (f"{at}.{theirs}", shape,
                       lambda ours=ours, i=i, to_theirs=to_theirs: to_theirs(read(ours, i)))
            if experts:
                yield from expert_pieces(read, STACKED, EXPERTS[cfg.family][1], i, at,
                                         ((F, D), (F, D), (D, F)), cfg.n_experts)
    yield "model.norm.weight", (D,), lambda: read("norm_f.scale", None)
    if not cfg.tie_embeddings:
        yield "lm_head.weight", (V, D), lambda: read("w_head", None)[:V]
    if cfg.mtp_depth:  # only where asked (models.hf_export_config); after the layers, in its files
        yield from deepseek_hf.mtp_pieces(cfg, read)
