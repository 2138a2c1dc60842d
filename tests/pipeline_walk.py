"""One pipelined step for every schedule and microbatch count 1..8 on one
mesh, each loss against the 1-device step on the same batch.

    python -m tests.pipeline_walk pipe=2,fsdp=4 [SCHEDULE:M ...]

Run as its own process by tests/test_pipeline_order.py: a program whose
devices disagree on the order of their collectives does not fail, it hangs
until XLA:CPU's rendezvous aborts the process, so each configuration is
printed before it runs (the last line names the one that hung) and after.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from tests.helpers import first_step, host, make_job
from zero_jax.data import corpus as corpus_lib
from zero_jax.pipeline.schedule import SCHEDULES

MICROBATCHES = range(1, 9)
# gpt-tiny as the runs that hung had it (at seq_len 16, or 8 layers over 2
# stages, the same schedules did not hang on jaxlib 0.11.2), with 2 layers
# per stage so that interleaving has its 2 chunks each.
SEQ_LEN = 128


def rows(m: int) -> int:
    """A batch whose m microbatches each split over 8 devices' batch axes."""
    return 8 * m


def layers(mesh: str) -> int:
    return 2 * int(dict(axis.split("=") for axis in mesh.split(","))["pipe"])


def main(argv: list[str]) -> None:
    mesh, *only = argv
    common = dict(seq_len=SEQ_LEN, n_layer=layers(mesh))
    walk = [(s, m) for s in SCHEDULES for m in MICROBATCHES]
    if only:
        walk = [(s, int(m)) for s, m in (c.split(":") for c in only)]
    corpus = corpus_lib.stdlib_corpus()
    reference = {}
    for schedule, m in walk:
        batch = rows(m)
        if batch not in reference:
            one = make_job(corpus, **common, batch_size=batch, mesh="fsdp=1",
                           devices=jax.devices()[:1])
            reference[batch] = float(host(first_step(one, corpus))[0])
        print(f"run {schedule} m={m}", flush=True)
        job = make_job(corpus, **common, batch_size=batch, mesh=mesh, pipeline_schedule=schedule,
                       microbatches=m, zero_stage=3)
        loss = float(host(first_step(job, corpus))[0])
        np.testing.assert_allclose(loss, reference[batch], rtol=1e-5,
                                   err_msg=f"{schedule} m={m} on {mesh}")
        print(f"ok {schedule} m={m} loss {loss:.6f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
