"""The embedding and head tables under a pipeline's training: each used in
the row blocks over `pipe` it is stored in (pipeline/train_stage.py), or
gathered and summed whole where `pipe` does not divide its rows; both as
one device computes them."""

import re

import jax
import numpy as np
import pytest

from tests.helpers import assert_close, host, initial_state, make_job
from zero_jax.analysis import hlo
from zero_jax.data import corpus as corpus_lib

SHAPE = dict(seq_len=16, batch_size=32, n_layer=8)
D_MODEL = 192  # gpt-tiny's
# pipe=4: the vocabulary's 256 rows and 256 positions divide into row blocks;
# 30 positions, or a vocabulary of 258, do not (each is still stored split
# over pipe, by columns).
CASES = {
    "both-in-rows": ({}, ()),
    "positions-whole": (dict(max_seq_len=30), ((30, D_MODEL),)),
    "both-whole": (dict(vocab_size=258), ((258, D_MODEL), (256, D_MODEL))),
    "whole-as-asked": (dict(pipeline_tables="whole"), ((256, D_MODEL),)),  # --pipeline-tables
}


def _loss_and_grads(job, corpus):
    """The first batch's loss and gradients, and the compiled program's text."""
    t = job.run.train
    batch = corpus_lib.global_batch(corpus, "train", job.run.data.seq_len, t.batch_size, t.seed,
                                  step=0, sharding=job.state_plan.batch_sharding)
    params = initial_state(job).params
    compiled = job.jit_loss_and_grads().lower(params, batch).compile()
    return compiled(params, batch), compiled.as_text()


def _tables_summed_over_pipe(job, text) -> set[tuple[int, int]]:
    """(rows, columns) of the table-shaped results of all-reduces over `pipe`
    (a table's gradient summed whole: XLA combines them into tuples)."""
    mesh = job.state_plan.mesh
    rows = {30, 256, 258}  # the tables' row counts in CASES (sequences are 16 long)
    found = set()
    for c in hlo.collectives(text):
        if c.op == "all-reduce" and "pipe" in (c.axes(mesh) or ()):
            result = c.line.split(" all-reduce(")[0]
            for dims in re.findall(r"\w+\[([\d,]+)\]", result):
                shape = tuple(int(d) for d in dims.split(","))
                if len(shape) >= 2 and shape[-1] == D_MODEL and shape[-2] in rows:
                    found.add(shape[-2:])
    return found


@pytest.mark.parametrize("case", CASES)
def test_tables_train_in_their_row_blocks_where_pipe_divides_them(corpus, case):
    """Tables in row blocks: every stage looks its rows up, computes its block
    of the logits and adds its block's gradient, so no table is gathered or
    summed whole over `pipe`; a table `pipe` does not divide is (and only
    it), as is every table under `--pipeline-tables whole`. Loss and
    gradients match one device's either way."""
    extra, whole = CASES[case]
    job = make_job(corpus, **SHAPE, **extra, mesh="pipe=4,data=2", pipeline_schedule="1f1b",
                   microbatches=4, zero_stage=1)
    ref = make_job(corpus, **SHAPE, **extra, mesh="fsdp=1", devices=jax.devices()[:1])
    (loss, grads), text = _loss_and_grads(job, corpus)
    (ref_loss, ref_grads), _ = _loss_and_grads(ref, corpus)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_close(host(grads), host(ref_grads))
    assert _tables_summed_over_pipe(job, text) == set(whole)
    mesh = job.state_plan.mesh
    gathered = [c.shape for c in hlo.collectives(text)
                if c.op == "all-gather" and "pipe" in (c.axes(mesh) or ())]
    assert bool(gathered) == bool(whole), gathered
