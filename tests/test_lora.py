"""LoRA (zero_jax/model/lora.py): adapters on a frozen base, trained on a
ZeRO-3 layout like on one device; the base has no gradient, no reduction
and no optimizer state; the adapters' products equal the merged weight's;
what cannot work yet is refused before compiling.

CI runs fsdp=8 at ZeRO-3 and fsdp=4,tensor=2; ZERO_JAX_FULL_GRID=1 adds
ZeRO-1 over data and parameter offload.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests.helpers import compile_step, host, make_job
from zero_jax import run
from zero_jax.analysis import memory, traffic
from zero_jax.checkpoint import export
from zero_jax.checkpoint import manager as manager_lib
from zero_jax.checkpoint import weights
from zero_jax.config.sections import ConfigError
from zero_jax.data import corpus as corpus_lib
from zero_jax.model import lora

FULL = bool(os.environ.get("ZERO_JAX_FULL_GRID"))
CORPUS = [corpus_lib.stdlib_corpus()]  # what _steps reads (the suite's corpus fixture's)
LAYOUTS = [("fsdp=8", 3, {}), ("fsdp=4,tensor=2", 3, {}), ("data=8", 1, {}),
           ("fsdp=8", 3, {"offload_params": True})]
CASES = LAYOUTS if FULL else LAYOUTS[:2]
LORA = dict(model="llama-tiny", precision="fp32", lora_rank=8, lora_alpha=16.0,
            lora_targets="q,v")


def _steps(job, state, first, last):
    """Steps first..last - 1 from `state`: the state after them and their losses."""
    step_fn, t, losses = compile_step(job), job.run.train, []
    for i in range(first, last):
        batch = corpus_lib.global_batch(CORPUS[0], "train", job.run.data.seq_len, t.batch_size,
                                        t.seed, step=i, sharding=job.state_plan.batch_sharding)
        state, metrics = step_fn(state, batch)
        losses.append(float(metrics["loss"]))
    return state, np.array(losses)


def _hf_base(corpus, directory, scale: float):
    """llama-tiny with weights no initialisation gives (normal, `scale`),
    saved in Hugging Face's layout in `directory`: (its full job, the weights)."""
    full = make_job(corpus, model="llama-tiny", precision="fp32", mesh="fsdp=8", zero_stage=3)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(scale=scale, size=x.shape).astype(x.dtype),
                          host(full.init_state().params))

    def read(path, layer):
        x = params
        for key in path.split("."):
            x = x[key]
        return np.asarray(x if layer is None else x[layer])
    models.save_hf(directory, full.model.config, read)
    return full, params


def _train(corpus, mesh, stage, devices=None, **extra):
    """Ten steps: the losses, the adapters and the frozen base after them,
    and the base as initialised."""
    job = make_job(corpus, mesh=mesh, zero_stage=stage, devices=devices, **{**LORA, **extra})
    state = job.init_state()
    base = host(state.frozen)
    step_fn, t, losses = compile_step(job), job.run.train, []
    for i in range(t.steps):
        batch = corpus_lib.global_batch(corpus, "train", job.run.data.seq_len, t.batch_size,
                                        t.seed, step=i, sharding=job.state_plan.batch_sharding)
        state, metrics = step_fn(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), host(state.params), host(state.frozen), base


@pytest.fixture(scope="module")
def reference(corpus):
    return _train(corpus, "fsdp=1", 3, devices=jax.devices()[:1])


@pytest.mark.parametrize("mesh,stage,extra", CASES)
def test_lora_trains_like_one_device(corpus, reference, mesh, stage, extra):
    """Rank-8 adapters on q and v: ten steps' losses and adapters as on one
    device to 1e-5, the base bitwise as initialised, and initialised as
    the model without adapters is (the adapters start at B = 0: the
    adapted model is the base)."""
    losses, adapters, frozen, base = _train(corpus, mesh, stage, **extra)
    ref_losses, ref_adapters, ref_frozen, _ = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 adapters, ref_adapters)
    jax.tree.map(np.testing.assert_array_equal, frozen, base)
    jax.tree.map(np.testing.assert_array_equal, frozen, ref_frozen)
    assert ref_losses[-1] < ref_losses[0]  # the adapters learn
    plain = make_job(corpus, model="llama-tiny", precision="fp32", mesh="fsdp=1", zero_stage=3,
                     devices=jax.devices()[:1])
    jax.tree.map(np.testing.assert_array_equal, base, host(plain.init_state().params))
    assert {k: sorted(v) for k, v in adapters["blocks"].items()} == {
        "w_q_lora": ["a", "b"], "w_v_lora": ["a", "b"]}


def test_the_base_has_no_gradient_reduction_and_no_optimizer_state(corpus):
    """The compiled ZeRO-3 step on fsdp=8 reduces the adapters' gradients
    and nothing of the base's: its all-reduce payload is the adapters'
    float32 gradients plus the loss, where a full fine-tune's is every
    parameter's; the optimizer state holds the adapters' moments only."""
    def reduced(**extra):
        job = make_job(corpus, model="llama-tiny", precision="fp32", mesh="fsdp=8",
                       zero_stage=3, **extra)
        by_op = traffic.traffic(job.lower_train_step().compile().as_text(),
                                job.state_plan.mesh).by_op
        reductions = sum(v for k, v in by_op.items() if k.startswith(("all-reduce",
                                                                       "reduce-scatter")))
        elements = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(job.state_plan.abstract.params))
        return job, reductions, elements
    full, full_bytes, full_elements = reduced()
    job, lora_bytes, adapters = reduced(**{k: v for k, v in LORA.items() if k.startswith("lora")})
    print(f"all-reduce bytes per step: full fine-tune {full_bytes:,} ({full_elements:,} "
          f"parameters), LoRA {lora_bytes:,} ({adapters:,} adapter parameters)")
    assert 4 * adapters <= lora_bytes <= 4 * adapters + 64  # the loss's scalar besides
    assert 4 * full_elements <= full_bytes
    base = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(job.state_plan.abstract.frozen))
    assert base == full_elements  # every parameter of the full fine-tune is frozen here
    moments = [x.shape for x in jax.tree.leaves(job.state_plan.abstract.opt_state) if x.ndim]
    assert sorted(moments) == sorted(2 * [x.shape for x in jax.tree.leaves(
        job.state_plan.abstract.params)])
    assert not job.state_plan.master


@pytest.mark.parametrize("eq,shape,names,x_shape", [
    ("btd,dhq->bthq", (16, 4, 8), ("embed", "heads", "kv"), (2, 5, 16)),  # q: out over heads
    ("bthq,hqd->btd", (4, 8, 16), ("heads", "kv", "embed"), (2, 5, 4, 8)),  # o: in over heads
    ("btd,df->btf", (16, 24), ("embed", "mlp"), (2, 5, 16))])
def test_the_two_products_equal_the_merged_weight(eq, shape, names, x_shape):
    """x A then B equals x (A B): the adapter's term of every shape of
    product the block has; A and B keep W's logical axes."""
    (eq_a, shape_a, names_a), (eq_b, shape_b, names_b) = lora.factors(eq, shape, names, 3)
    rng = np.random.default_rng(0)
    x, a, b = (rng.normal(size=s) for s in (x_shape, shape_a, shape_b))
    ins = len(shape_a) - 1  # A: W's input dimensions, then the rank
    delta = np.tensordot(a, b, axes=([ins], [0]))  # W's input then output dimensions
    ws = eq.split(",")[1].split("->")[0]
    xs = eq.split(",")[0]
    order = [c for c in ws if c in xs] + [c for c in ws if c not in xs]
    delta = np.transpose(delta, [order.index(c) for c in ws])  # in W's own order
    np.testing.assert_allclose(np.einsum(eq_b, np.einsum(eq_a, x, a), b),
                               np.einsum(eq, x, delta), rtol=1e-10)
    assert delta.shape == shape
    assert set(names_a) | set(names_b) == set(names) | {None}


def test_lora_composes_with_context_parallelism_and_fp8(corpus, reference):
    """context=2,fsdp=4 (ring attention) trains as one device to 1e-5.
    (ZERO_JAX_FULL_GRID=1) Under delayed FP8 scaling the amax histories are trained beside the
    adapters: each step shifts them a column, as in a full run, and the
    base stays as it was; the loss falls."""
    losses, adapters, _, _ = _train(corpus, "context=2,fsdp=4", 3)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 adapters, reference[1])
    if not FULL:  # CI: context; ZERO_JAX_FULL_GRID=1 adds FP8
        return
    losses, adapters, frozen, base = _train(corpus, "fsdp=8", 3, precision="fp8", fp8="delayed",
                                            fp8_history=16)
    history = adapters["blocks"]["w_q_fp8_history"]  # (layers, rows, steps)
    assert np.all(history[..., :10] > 0) and not np.any(history[..., 10:])
    jax.tree.map(np.testing.assert_array_equal, frozen, base)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("extra,says", [
    (dict(lora_targets="q,x"), "--lora-targets 'q,x': x; choose from q,k,v,o,gate,up,down"),
    (dict(model="gpt-tiny"), "gpt-tiny has none of these projections"),
    (dict(mesh="pipe=2,data=4", zero_stage=1), "pipe=2")])
def test_what_lora_cannot_do_yet_is_refused_before_compiling(corpus, tmp_path, extra, says):
    (tmp_path / "config.json").write_text("{}")  # a directory --init-from accepts
    extra = {k: v.format(hf=tmp_path) if isinstance(v, str) else v for k, v in extra.items()}
    with pytest.raises((ConfigError, ValueError), match=says.replace("(", r"\(")):
        make_job(corpus, **{**LORA, "mesh": "fsdp=8", **extra})


def test_adapters_split_from_and_merge_into_the_tree():
    tree = {"blocks": {"w_q": 1, "w_q_lora": {"a": 2, "b": 3}, "norm": {"scale": 4}},
            "wte": 5}
    adapters, frozen = lora.split(tree)
    assert adapters == {"blocks": {"w_q_lora": {"a": 2, "b": 3}}}
    assert frozen == {"blocks": {"w_q": 1, "norm": {"scale": 4}}, "wte": 5}
    assert lora.merge(adapters, frozen) == tree
    assert lora.has_adapters(tree) and not lora.has_adapters(frozen)
    assert jnp.asarray(lora.Lora(8, 16.0, ("q",)).scale) == 2.0


def test_the_base_is_read_from_a_checkpoint_or_a_hugging_face_directory(corpus, tmp_path):
    """--init-from a full run's checkpoint, or a Hugging Face directory:
    the frozen base is its weights, cast to the compute dtype (bfloat16
    here) in the base's layout; the adapters start fresh (B = 0)."""
    full, params = _hf_base(corpus, tmp_path / "hf", scale=1.0)
    state = full.state_from_params(params)
    writer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(tmp_path / "ckpt")),
                                      full.state_plan.names, writer=True)
    writer.save(0, full.state_plan.saved_form(state), run.checkpoint_meta(full, 0))
    writer.wait()
    bf16 = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16)), params)
    for source, model in ((tmp_path / "ckpt", "llama-tiny"), (tmp_path / "hf", f"hf:{tmp_path / 'hf'}")):
        job = make_job(corpus, **{**LORA, "precision": "bf16", "model": model,
                                  "init_from": str(source), "mesh": "fsdp=4,tensor=2"})
        loaded, _, _ = run.initial_state(job, None, [models.hf_loader], print)
        jax.tree.map(np.testing.assert_array_equal, host(loaded.frozen), bf16)
        assert jax.tree.map(lambda x: x.sharding, loaded.frozen) == \
            job.state_plan.shardings.frozen
        assert not any(np.any(b["b"]) for b in host(loaded.params)["blocks"].values())


def test_a_lora_checkpoint_resumes_onto_another_layout_and_only_onto_its_base(corpus, tmp_path):
    """Adapters saved at step 3 of 6 on fsdp=8 (ZeRO-3), with the digest of
    the base they were trained on in the meta, resume on fsdp=4,tensor=2:
    the base is read again (the seed's initialisation here), checked, and
    the last 3 losses are the straight run's to 1e-5. A run whose base has
    other weights (another seed) is refused, naming the one saved."""
    job = make_job(corpus, **{**LORA, "mesh": "fsdp=8", "zero_stage": 3, "dir": str(tmp_path)})
    state, _, _ = run.initial_state(job, None, [], print)
    state, _ = _steps(job, state, 0, 3)
    writer = manager_lib.Checkpointer(job.run.checkpoint, job.state_plan.names, writer=True)
    writer.save(3, job.state_plan.saved_form(state),
                {**run.checkpoint_meta(job, 3), **weights.base_meta(job, weights.digest(state.frozen))})
    writer.wait()
    _, straight = _steps(job, state, 3, 6)

    def resumed(**extra):
        again = make_job(corpus, **{**LORA, "mesh": "fsdp=4,tensor=2", "zero_stage": 3,
                                    "dir": str(tmp_path), "resume": True, **extra})
        return again, run.initial_state(again, manager_lib.Checkpointer(again.run.checkpoint),
                                        [], print)
    again, (state, step, _) = resumed()
    assert step == 3
    _, losses = _steps(again, state, 3, 6)
    np.testing.assert_allclose(losses, straight, rtol=1e-5, atol=1e-5)
    with pytest.raises(weights.WrongBase, match="trained on the base from the initialisation "
                       "of seed 0, this run's comes from the initialisation of seed 1; give "
                       "--seed 0 and no --init-from"):
        resumed(seed=1)
    with pytest.raises(weights.WrongBase, match="seed 1"):  # what the CLI checks before compiling
        weights.check_base_source(make_job(corpus, **{**LORA, "dir": str(tmp_path),
                                                      "resume": True, "seed": 1}))
    meta = json.loads((tmp_path / "3" / "meta" / "metadata").read_text())
    meta["lora_base"]["digest"] = "0" * 64  # as if the base's files had changed since
    (tmp_path / "3" / "meta" / "metadata").write_text(json.dumps(meta))
    with pytest.raises(weights.WrongBase, match="whose weights have changed since"):
        resumed()


def test_adapters_go_to_peft_and_come_back_bit_for_bit(corpus, tmp_path):
    """A LoRA checkpoint exported with --peft-dir (adapter_config.json and
    adapter_model.safetensors, peft's names and shapes) and read back with
    --lora-init-from gives the same adapters, bit for bit, on another
    layout; the same directory under another rank is refused, naming it."""
    from zero_jax.cli import export as export_cli
    job = make_job(corpus, **{**LORA, "lora_targets": "q,k,v,o,gate,up,down", "mesh": "fsdp=8"})
    state, _ = _steps(job, job.init_state(), 0, 2)
    writer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(tmp_path / "ckpt")),
                                      job.state_plan.names, writer=True)
    writer.save(2, job.state_plan.saved_form(state),
                {**run.checkpoint_meta(job, 2), **weights.base_meta(job, weights.digest(state.frozen))})
    writer.wait()
    assert export_cli.main(["--checkpoint-dir", str(tmp_path / "ckpt"), "--peft-dir",
                            str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 16.0, "LORA")
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj",
                                               "gate_proj", "up_proj", "down_proj"])
    names = export.SafetensorsFile(tmp_path / "peft" / "adapter_model.safetensors")
    assert names.shape("base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight") == \
        (8, 256)  # (r, H Q)
    assert names.shape("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight") == (256, 8)

    def imported(**extra):
        again = make_job(corpus, **{**LORA, "lora_targets": "q,k,v,o,gate,up,down",
                                    "mesh": "fsdp=4,tensor=2", "lora_init_from":
                                    str(tmp_path / "peft"), **extra})
        return run.initial_state(again, None, [models.peft_loader], print)[0]
    jax.tree.map(np.testing.assert_array_equal, host(imported().params), host(state.params))
    with pytest.raises(ValueError, match="r 8 there, 4 here"):
        imported(lora_rank=4)


def test_merged_export_computes_the_adapted_model_and_checks_its_base(corpus, tmp_path):
    """export --hf-dir --merge-lora: the base read where the checkpoint names
    it (a Hugging Face directory), checked by its digest, each adapted
    weight plus (alpha / r) A B; imported back as a plain model it computes
    the LoRA model's logits to 1e-5. A base whose file changed since is
    refused, and nothing is written."""
    from safetensors.numpy import load_file, save_file

    from zero_jax.cli import export as export_cli
    full, params = _hf_base(corpus, tmp_path / "base", scale=0.05)
    job = make_job(corpus, **{**LORA, "lora_targets": "q,o,up", "model": f"hf:{tmp_path / 'base'}",
                              "init_from": str(tmp_path / "base"), "lr": 0.01,
                              "mesh": "fsdp=8"})
    state, _, _ = run.initial_state(job, None, [models.hf_loader], print)
    state, _ = _steps(job, state, 0, 3)
    writer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(tmp_path / "ckpt")),
                                      job.state_plan.names, writer=True)
    writer.save(3, job.state_plan.saved_form(state),
                {**run.checkpoint_meta(job, 3), **weights.base_meta(job, weights.digest(state.frozen))})
    writer.wait()
    tokens = np.random.default_rng(1).integers(0, 256, size=(8, 24))

    def logits_of(j, p):
        return np.asarray(jax.jit(lambda p, t: j.model.logits(p, t, j.hooks))(p, tokens))
    assert export_cli.main(["--checkpoint-dir", str(tmp_path / "ckpt"), "--hf-dir",
                            str(tmp_path / "merged"), "--merge-lora"]) == 0
    merged = make_job(corpus, model=f"hf:{tmp_path / 'merged'}", precision="fp32",
                      mesh="fsdp=8", init_from=str(tmp_path / "merged"))
    plain, _, _ = run.initial_state(merged, None, [models.hf_loader], print)
    ours, theirs = logits_of(job, state.model_params), logits_of(merged, plain.params)
    assert np.abs(ours - logits_of(full, full.state_from_params(params).params)).max() > 1e-3
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)
    files = load_file(str(tmp_path / "base" / "model.safetensors"))
    files["model.norm.weight"] = files["model.norm.weight"] * 2  # the base changed since
    save_file(files, str(tmp_path / "base" / "model.safetensors"), metadata={"format": "pt"})
    assert export_cli.main(["--checkpoint-dir", str(tmp_path / "ckpt"), "--hf-dir",
                            str(tmp_path / "again"), "--merge-lora"]) == 2
    assert not (tmp_path / "again").exists()


def test_the_memory_report_counts_the_frozen_base(corpus):
    """Under bf16 the base is stored in bfloat16, split as a full fine-tune
    stores its float32 parameters: exactly half their bytes per device; the
    adapters (left whole here: under min_shard_elements a layer) add their
    float32 bytes, and only they have gradients and Adam's moments. The
    model's count includes the base, and says what LoRA trains."""
    full = make_job(corpus, model="llama-tiny", precision="bf16", mesh="fsdp=8", zero_stage=3)
    job = make_job(corpus, **{**LORA, "precision": "bf16", "mesh": "fsdp=8", "zero_stage": 3})
    whole, adapted = memory.report(full.state_plan), memory.report(job.state_plan)
    adapters = memory.trained_count(job.state_plan)
    assert (adapted.param_count, adapted.trained_count) == (whole.param_count + adapters, adapters)
    assert adapted.sharded_bytes["params"] == whole.sharded_bytes["params"] // 2 + 4 * adapters
    assert adapted.sharded_bytes["grads"] == 4 * adapters
    assert 8 * adapters <= adapted.sharded_bytes["opt_state"] <= 8 * adapters + 64  # + counts
    assert adapted.device_bytes == adapted.sharded_bytes  # nothing offloaded
