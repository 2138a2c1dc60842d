"""DeepSeek-V3's architecture (models/llama: latent attention in mla.py,
DeepSeekMoE routing in moe.py, aux-loss-free balancing in
zero_jax/model/balance.py): the published parameter counts, the router
against a per-token reference of transformers' DeepseekV3TopkRouter, every
layout trained against one device with the bias update on, and the
balance the bias buys.

CI runs expert=4,data=2, one pipeline (1F1B) and ring attention over
`context` (the MTP module's shifted rows laid out across it);
ZERO_JAX_FULL_GRID=1 adds ZeRO-3 with tensor parallelism, an
interleaved pipeline at ZeRO-3, and the expert axis over two simulated
nodes (the two-hop dispatch).
"""

import os

import jax
import numpy as np
import pytest

import models
from models.llama import model as model_lib
from models.llama import moe
from tests.helpers import assert_close, compile_step, host, initial_state, make_job
from zero_jax.config.sections import ConfigError
from zero_jax.context import order as context_order
from zero_jax.data import corpus as corpus_lib
from zero_jax.model import balance
from zero_jax.model.hooks import Hooks

FULL = bool(os.environ.get("ZERO_JAX_FULL_GRID"))
# (mesh, ZeRO stage, pipeline schedule or context attention)
LAYOUTS = [("expert=4,data=2", 1, ""), ("pipe=2,expert=2,data=2", 1, "1f1b"),
           ("context=2,data=4", 1, "ring"),
           ("expert=2,fsdp=2,tensor=2", 3, ""), ("pipe=2,expert=2,data=2", 3, "interleaved"),
           ("meshes/cpu-2x4-experts.toml", 1, "")]  # two hops over 2 simulated nodes
CASES = LAYOUTS if FULL else LAYOUTS[:3]
# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3 on the Hugging Face Hub), as published.
V3_CONFIG = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                 moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                 n_shared_experts=1, n_routed_experts=256, kv_lora_rank=512, q_lora_rank=1536,
                 qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                 first_k_dense_replace=3, tie_word_embeddings=False)
# Kimi-K2's (moonshotai/Kimi-K2-Base): the same architecture, the keys that differ.
KIMI_CONFIG = {**V3_CONFIG, "vocab_size": 163840, "num_attention_heads": 64,
               "n_routed_experts": 384, "first_k_dense_replace": 1}


def checkpoint_tensors(c: dict, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of DeepSeek's checkpoint layout (one layer of each kind,
    with its count), by shape, from config.json alone: what its
    model.safetensors.index.json lists; with `mtp`, its MTP layer too
    (model.layers.61: a mixture layer, enorm, hnorm, eh_proj, shared_head's
    norm, and copies of the embedding and head)."""
    D, H, V = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    Cq, C, R = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    N, Vh, E, F = c["qk_nope_head_dim"], c["v_head_dim"], c["n_routed_experts"], \
        c["moe_intermediate_size"]
    attn = {"q_a_proj": (Cq, D), "q_a_layernorm": (Cq,), "q_b_proj": (H * (N + R), Cq),
            "kv_a_proj_with_mqa": (C + R, D), "kv_a_layernorm": (C,),
            "kv_b_proj": (H * (N + Vh), C), "o_proj": (D, H * Vh), "input_layernorm": (D,),
            "post_attention_layernorm": (D,)}
    dense = {f"mlp.{p}": s for p, s in (("gate_proj", (c["intermediate_size"], D)),
                                        ("up_proj", (c["intermediate_size"], D)),
                                        ("down_proj", (D, c["intermediate_size"])))}
    S = F * c["n_shared_experts"]
    moe_layer = {"mlp.gate.weight": (E, D), "mlp.gate.e_score_correction_bias": (E,),
                 "mlp.experts.gate_proj": (E, F, D), "mlp.experts.up_proj": (E, F, D),
                 "mlp.experts.down_proj": (E, D, F), "mlp.shared_experts.gate_proj": (S, D),
                 "mlp.shared_experts.up_proj": (S, D), "mlp.shared_experts.down_proj": (D, S)}
    k, L = c["first_k_dense_replace"], c["num_hidden_layers"]
    out = {"embed_tokens": (V, D), "norm": (D,), "lm_head": (V, D)}
    out.update({f"dense.{n}": (k, *s) for n, s in {**attn, **dense}.items()})
    out.update({f"moe.{n}": (L - k, *s) for n, s in {**attn, **moe_layer}.items()})
    if mtp:
        out.update({f"mtp.{n}": s for n, s in {**attn, **moe_layer}.items()})
        out.update({"mtp.enorm": (D,), "mtp.hnorm": (D,), "mtp.eh_proj": (D, 2 * D),
                    "mtp.shared_head.norm": (D,), "mtp.embed_tokens": (V, D),
                    "mtp.shared_head.head": (V, D)})
    return out


def _built(cfg) -> int:
    shapes = jax.eval_shape(models.model_fns(cfg).init, jax.random.key(0))
    return sum(int(np.prod(x.value.shape)) for x in jax.tree.leaves(
        shapes, is_leaf=lambda x: hasattr(x, "value")))


def test_deepseek_v3_preset_has_the_published_parameter_count():
    """671,026,419,200 parameters from config.json's shapes without the MTP
    module (DeepSeek-V3's "671B"), 684,489,845,504 with its layer as the
    checkpoint stores it; the preset's formula and built arrays give the
    same, less the copies of the embedding and head that layer stores (the
    module shares the model's, as the paper has it): 11,610,068,224 of its
    own (DeepSeek's README: "11.5B unique parameters"). 37.6B active per
    token without MTP (published: 37B). Kimi-K2's 1.026T from its config.json alike."""
    V, D = V3_CONFIG["vocab_size"], V3_CONFIG["hidden_size"]
    without = sum(int(np.prod(s)) for s in checkpoint_tensors(V3_CONFIG).values())
    with_mtp = sum(int(np.prod(s)) for s in checkpoint_tensors(V3_CONFIG, mtp=True).values())
    assert (without, with_mtp) == (671_026_419_200, 684_489_845_504)
    v3, plain = models.config("deepseek-v3", 256), models.config("deepseek-v3", 256, mtp_depth=0)
    assert v3.param_count == _built(v3) == with_mtp - 2 * V * D
    assert plain.param_count == _built(plain) == without
    assert v3.param_count - plain.param_count == 11_610_068_224
    kimi, published = models.config("kimi-k2", 256), sum(
        int(np.prod(s)) for s in checkpoint_tensors(KIMI_CONFIG).values())
    assert kimi.param_count == _built(kimi) == published == 1_026_408_232_448
    assert 37.0e9 < plain.active_param_count < 38.0e9


def _reference_route(logits, bias, k, groups, topk_groups, scale):
    """transformers' DeepseekV3TopkRouter, per token, in numpy float64."""
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + bias
    N, E = logits.shape
    out_e, out_w = [], []
    for n in range(N):
        per_group = choice[n].reshape(groups, -1)
        group_score = np.sort(per_group, axis=1)[:, -2:].sum(1)
        allowed = np.argsort(-group_score, kind="stable")[:topk_groups]
        masked = np.full(E, -np.inf)
        for g in allowed:
            masked[g * E // groups:(g + 1) * E // groups] = per_group[g]
        top = np.argsort(-masked, kind="stable")[:k]
        w = scores[n, top]
        out_e.append(sorted(top))
        out_w.append(dict(zip(top, w / (w.sum() + 1e-20) * scale)))
    return out_e, out_w


def test_group_limited_sigmoid_routing_matches_transformers_rule():
    """Sigmoid scores, the bias in the choice only, a token's experts from
    its best groups by their top-2 sums, weights renormalised and scaled."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 16)).astype(np.float32)
    bias = rng.normal(scale=0.3, size=16).astype(np.float32)
    r = moe.route(logits, 4, True, sigmoid=True, bias_E=bias, groups=(4, 2), scale=2.5)
    experts, weights = _reference_route(logits.astype(np.float64), bias, 4, 4, 2, 2.5)
    got_e = np.asarray(r.experts_Nxk)
    assert [sorted(e) for e in got_e.tolist()] == [list(map(int, e)) for e in experts]
    for n in range(64):
        for j, e in enumerate(got_e[n]):
            assert abs(float(r.weights_Nxk[n, j]) - weights[n][e]) < 1e-5
        groups = {int(e) // 4 for e in got_e[n]}
        assert len(groups) <= 2  # topk_group = 2 of 4 groups


def _job(corpus, mesh, stage, schedule="", **extra):
    # Two microbatches of 8 rows on 8 data-parallel devices; a pipeline's four.
    pipelined = schedule in ("1f1b", "interleaved")
    fields = dict(model="deepseek-tiny", mesh=mesh, zero_stage=stage, precision="fp32",
                  batch_size=16, seq_len=32, microbatches=4 if pipelined else 2)
    if pipelined:
        fields["pipeline_schedule"] = schedule
    elif schedule:
        fields["context_attention"] = schedule
    return make_job(corpus, **{**fields, **extra})


def _train(job, corpus, steps=None):
    """The steps' losses and expert-load ratios, and the final parameters."""
    step_fn = compile_step(job)
    state = initial_state(job)
    t = job.run.train
    losses, loads = [], []
    for i in range(steps or t.steps):
        batch = corpus_lib.global_batch(corpus, "train", job.run.data.seq_len, t.batch_size,
                                        t.seed, step=i, sharding=job.state_plan.batch_sharding)
        state, metrics = step_fn(state, batch)
        losses.append(float(metrics["loss"]))
        loads.append(np.asarray(metrics["expert_load"]))
    return np.array(losses), np.array(loads), host(job.state_plan.saved_form(state).params)


@pytest.fixture(scope="module")
def references(corpus):
    """One device's run, with its MTP module or (for pipelines) without."""
    cache = {}

    def get(mtp_depth):
        if mtp_depth not in cache:
            job = _job(corpus, "fsdp=1", 0, devices=jax.devices()[:1], mtp_depth=mtp_depth)
            cache[mtp_depth] = _train(job, corpus)
        return cache[mtp_depth]
    return get


@pytest.mark.parametrize("mesh,stage,schedule", CASES)
def test_layouts_train_like_one_device_with_the_bias_moving(corpus, references, mesh, stage,
                                                            schedule):
    """Ten steps of deepseek-tiny (latent attention, a dense first layer,
    shared expert, 4 groups, sigmoid routing, bias rate 1e-3, one MTP
    module; a pipeline without it: the MTP module follows the head) on each
    layout: losses and parameters, the selection biases included, as on
    one device; and the biases did move (by multiples of the rate)."""
    mtp_depth = 0 if mesh.startswith("pipe") else 1
    losses, _, params = _train(_job(corpus, mesh, stage, schedule, mtp_depth=mtp_depth), corpus)
    ref_losses, _, ref_params = references(mtp_depth)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_close(params, ref_params)
    bias = params["blocks"]["moe"][balance.NAME]
    np.testing.assert_array_equal(bias, ref_params["blocks"]["moe"][balance.NAME])
    assert np.abs(bias).max() > 0
    steps = bias / 1e-3
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)


def test_aux_loss_free_balancing_evens_the_experts_loads(corpus):
    """Training with the bias update (rate 1e-2 here, to act within a short
    run) ends with a lower busiest-expert-over-mean load than the same run
    with the bias fixed (docs/experts.md: 300 steps at the presets' 1e-3)."""
    def run(rate):
        job = _job(corpus, "fsdp=1", 0, devices=jax.devices()[:1], microbatches=1, steps=80,
                   router_bias_update_rate=rate)
        _, loads, _ = _train(job, corpus)
        return loads[-20:].mean()
    on, off = run(1e-2), run(0.0)
    print(f"max/mean expert load over the last 20 of 80 steps: bias update on {on:.3f}, "
          f"off {off:.3f}")
    assert on < off


def test_mtp_loss_is_the_loss_of_the_token_two_ahead(corpus):
    """The MTP module's loss as the model reports it equals one computed
    here: the main stack's output and the embedding of the next token
    through the module, the shared head, and the cross-entropy against the
    token two ahead of each position (the last position has none)."""
    job = _job(corpus, "fsdp=1", 0, devices=jax.devices()[:1])
    cfg, params = job.model.config, host(job.state_plan.saved_form(initial_state(job)).params)
    tokens = np.asarray(corpus_lib.global_batch(corpus, "train", 32, 4, 0, step=0,
                                                sharding=job.state_plan.batch_sharding)["tokens"])
    B, T = tokens.shape[0], tokens.shape[1] - 1
    batch = {"tokens": tokens, "weights": np.full((B, T), 1.0 / (B * T), np.float32)}
    rows = context_order.ahead(batch, 1, None)
    _, stats = model_lib.Llama(cfg).apply({"params": params}, tokens[:, :-1], None, rows)
    x = model_lib.Llama(cfg).apply({"params": params}, tokens[:, :-1],
                                   method=lambda m, t: m.stack(m.embed(t)))
    ahead = params["wte"][tokens[:, 1:]]
    _, normed = model_lib.MTP(cfg, Hooks()).apply({"params": params["mtp_0"]}, x, ahead, None)
    logits = np.asarray(normed @ params["w_head"].T, np.float64)[:, :T - 1]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, tokens[:, 2:, None], -1)[..., 0]
    expected = np.sum(logz - picked) / (B * T)
    np.testing.assert_allclose(float(stats["mtp_loss"]), expected, rtol=1e-5)


def test_bad_deepseek_shapes_are_refused_before_compiling(corpus):
    """A pipeline under MTP, groups that do not divide the experts, or a
    token's k experts that cannot fit in its groups: one line naming them."""
    with pytest.raises(ConfigError, match="multi-token prediction.*--mtp-depth 0"):
        _job(corpus, "pipe=2,expert=2,data=2", 1, "1f1b")
    with pytest.raises(ValueError, match="n_group=3 does not divide n_experts=8"):
        models.config("deepseek-tiny", 256, n_group=3)
    with pytest.raises(ValueError, match="topk_group=1 of n_group=4"):
        models.config("deepseek-tiny", 256, topk_group=1, n_experts_per_tok=4)


def test_routing_shape_flags_override_the_preset(corpus):
    """--n-group, --topk-group, --routed-scaling-factor and
    --first-k-dense-replace reach the model's config; on a GPT they are
    refused, named, before compiling."""
    cfg = make_job(corpus, model="deepseek-tiny", mesh="data=8", n_group=2, topk_group=1,
                   routed_scaling_factor=1.5, first_k_dense_replace=0).model.config
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor,
            cfg.first_k_dense_replace) == (2, 1, 1.5, 0)
    assert cfg.moe_layers == cfg.n_layer
    with pytest.raises((ConfigError, ValueError), match="n_group: Llama-family fields"):
        make_job(corpus, model="gpt-tiny", mesh="data=8", n_group=2)
    from models.common import decoder
    from zero_jax.config.sections import ModelConfig
    assert decoder.ZERO_IS_SET == set(ModelConfig.ZERO_IS_SET)  # the two lists agree


def test_export_leaves_the_mtp_module_out_unless_asked(corpus, tmp_path, capsys):
    """`zero-jax export --hf-dir` leaves the MTP module out (config.json's
    num_nextn_predict_layers 0, and a line says so; read back with
    --mtp-depth 1, refused naming --mtp-depth 0); with --with-mtp it is layer n_layer as DeepSeek's files
    hold it, every tensor checkpoint_tensors lists for that layer, and the
    import of that directory gives every parameter back bit for bit. A
    family whose files have no such layer is refused."""
    import json

    from models.common import hf_files
    from zero_jax import run
    from zero_jax.checkpoint import manager as manager_lib
    from zero_jax.cli import export as export_cli
    job = make_job(corpus, model="deepseek-tiny", mesh="data=1", devices=jax.devices()[:1])
    assert job.model.config.mtp_depth == 1
    rng = np.random.default_rng(0)  # every tensor distinct, the norms and the bias too
    state = job.state_from_params(jax.tree.map(
        lambda x: rng.normal(size=x.shape).astype(x.dtype),
        host(job.state_plan.saved_form(initial_state(job)).params)))
    writer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(tmp_path / "ckpt")),
                                      job.state_plan.names, writer=True)
    writer.save(0, job.state_plan.saved_form(state), run.checkpoint_meta(job, 0))
    writer.wait()
    params = host(job.state_plan.saved_form(state).params)

    def export(name, *flags):
        assert export_cli.main(["--checkpoint-dir", str(tmp_path / "ckpt"), "--hf-dir",
                                str(tmp_path / name), *flags]) == 0
        return tmp_path / name, json.loads((tmp_path / name / "config.json").read_text())

    def imported(directory):
        again = make_job(corpus, model=f"hf:{directory}", mesh="data=1", mtp_depth=1,
                         devices=jax.devices()[:1])
        return host(run.load_params(str(directory), again, loaders=[models.hf_loader]))

    L = job.model.config.n_layer
    plain, config = export("plain")
    assert config["num_nextn_predict_layers"] == 0
    assert "1 multi-token prediction module(s) left out" in capsys.readouterr().out
    assert not [n for n in hf_files.Tensors(plain).files if n.startswith(f"model.layers.{L}.")]
    with pytest.raises(ValueError, match="--mtp-depth 0"):
        imported(plain)
    full, config = export("mtp", "--with-mtp")
    assert config["num_nextn_predict_layers"] == 1
    tensors = hf_files.Tensors(full)

    def layer(i):
        return {n[len(f"model.layers.{i}."):]: tensors.shape(n) for n in tensors.files
                if n.startswith(f"model.layers.{i}.")}
    D, V = config["hidden_size"], config["vocab_size"]
    own = {"enorm.weight": (D,), "hnorm.weight": (D,), "eh_proj.weight": (D, 2 * D),
           "shared_head.norm.weight": (D,), "embed_tokens.weight": (V, D),
           "shared_head.head.weight": (V, D)}
    assert layer(L) == {**layer(L - 1), **own}  # a mixture layer's tensors and its own
    assert sum(int(np.prod(s)) for s in layer(L).values()) == sum(
        int(np.prod(s)) for n, s in checkpoint_tensors(config, mtp=True).items()
        if n.startswith("mtp."))
    jax.tree.map(np.testing.assert_array_equal, imported(full), params)
    with pytest.raises(ValueError, match="LlamaForCausalLM.*without --with-mtp"):
        models.hf_config_json(models.config("llama-tiny", 256, mtp_depth=1))
