"""What the two decoder families share: the scanned layer stack, the
functions the train step needs from a module with `embed`, `stack` and
`head` methods over parameters {..., "blocks": the stack}, and the parts
of their activation bytes."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from zero_jax.model import fp8
from zero_jax.model.contract import PipelineFns
from zero_jax.model.hooks import Hooks


class ActivationParts(NamedTuple):
    """Activation bytes of one microbatch, by when they are live."""

    kept: float  # what the layers keep for the backward pass, through all of it
    rebuilt: float  # one layer rebuilt in the backward pass (0 when nothing is rebuilt)
    head: float  # the head's logits-sized buffers, during its own backward only

    @property
    def peak(self) -> float:
        """At the peak of the backward pass: what is kept, and the larger of
        one rebuilt layer and the head."""
        return self.kept + max(self.rebuilt, self.head)

    def plus(self, more: "ActivationParts") -> "ActivationParts":
        """These parts with `more` kept and rebuilt beside them (the head's is these')."""
        return self._replace(kept=self.kept + more.kept, rebuilt=self.rebuilt + more.rebuilt)


def scanned(block: type[nn.Module], cfg: Any, hooks: Hooks, length: int | None = None,
            **attributes: Any) -> nn.Module:
    """`length` (default cfg.n_layer) `block`s as one scanned, stacked layer
    (remat per block), called as `(x, segments or None)`: every layer sees
    the same segments. `attributes`: the block's own fields beyond cfg and hooks."""
    length = cfg.n_layer if length is None else length
    remat = nn.remat(block, policy=hooks.remat.jax_policy(), prevent_cse=False)
    # Unrolled, the parameters keep their stacked layout (checkpoints are the
    # same); the program holds every layer, so it compiles longer, and the
    # compiler's cost analysis counts every layer (a loop body counts once).
    unroll = 1 if hooks.scan_layers else length
    return nn.scan(remat, variable_axes={"params": 0},
                   split_rngs={"params": True, "dropout": True}, in_axes=nn.broadcast,
                   length=length, unroll=unroll,
                   metadata_params={nn.PARTITION_NAME: "layers"})(cfg, hooks, **attributes)


def fns(module: type[nn.Module], block: type[nn.Module], cfg: Any,
        router_penalty: Any = None, stacked: int | None = None) -> dict[str, Any]:
    """init, apply, decay_mask, pipeline and router_penalty (ModelFns fields)
    of `module`; a mixture of experts gives its `router_penalty` (a
    function of the stats over every layer and the rows' weights, with a
    keyword `layers` for those of some of them: moe.penalty). `stacked`:
    the layers in "blocks", what a pipeline splits (default cfg.n_layer;
    fewer where the first layers are a stack of their own, run by `embed`)."""
    stacked = cfg.n_layer if stacked is None else stacked

    def init(key, hooks: Hooks | None = None):  # hooks: what the parameters depend on (FP8 histories)
        tokens = jnp.zeros((1, min(8, cfg.max_seq_len)), jnp.int32)
        return module(cfg, hooks or Hooks()).init(key, tokens)["params"]

    def apply(params, tokens_BxT, hooks, segments_BxT=None, rngs=None, **rows):
        # rngs: {"dropout": key} in LoRA's training with dropout (zero_jax/model/lora.py)
        return module(cfg, hooks).apply({"params": params}, tokens_BxT, segments_BxT,
                                        rngs=rngs, **rows)

    def decay_mask(params):
        # Matrices (named w*) decay; norms, biases, amax histories and selection biases do not.
        return jax.tree_util.tree_map_with_path(
            lambda path, _: str(path[-1].key).startswith("w") and not fp8.is_history(path), params)

    def stage(blocks, x_BxTxD, hooks):
        n = jax.tree.leaves(blocks)[0].shape[0]
        stack = scanned(block, cfg, hooks, length=n)
        return stack.apply({"params": blocks}, x_BxTxD, None)

    pipeline = PipelineFns(
        split=lambda params: ({k: v for k, v in params.items() if k != "blocks"}, params["blocks"]),
        merge=lambda outer, blocks: {**outer, "blocks": blocks},
        embed=lambda outer, tokens, hooks: module(cfg, hooks).apply({"params": outer}, tokens,
                                                                    method=module.embed),
        stage=stage,
        head=lambda outer, x, hooks: module(cfg, hooks).apply({"params": outer}, x,
                                                              method=module.head),
        vocab_parallel=True,
        penalty=None if router_penalty is None
        else functools.partial(router_penalty, layers=stacked),
    )
    return {"init": init, "apply": apply, "decay_mask": decay_mask, "pipeline": pipeline,
            "router_penalty": router_penalty}


# Fields whose zero is a choice (no router loss; dropless; a fixed bias; no
# multi-token prediction), not "the preset's".
ZERO_IS_SET = frozenset({"router_aux_loss_coef", "router_z_loss_coef", "capacity_factor",
                         "router_bias_update_rate", "mtp_depth", "mtp_loss_weight",
                         "first_k_dense_replace"})


def given(overrides: dict) -> dict:
    """The shape fields a run sets: not None, and not 0 or "" (the preset's),
    except booleans, whose False is a choice (an untied head), and the
    router's coefficients, whose 0 is one."""
    return {k: v for k, v in overrides.items()
            if v is not None and (isinstance(v, bool) or k in ZERO_IS_SET or v not in (0, ""))}
