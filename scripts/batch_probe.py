"""Write the batches a run would read, as each process reads them: to check
that every mesh and process count reads the same data.

    python scripts/batch_probe.py --data data/ --mesh fsdp=8 --steps-to-probe 0,7 --probe-out p/
    python scripts/launch.py -n 2 --devices-per-process 4 -- scripts/batch_probe.py \\
        --data data/ --mesh cpu-2x4 --steps-to-probe 0,7 --probe-out p/

Takes train.py's flags (the mesh, batch size, sequence length, seed and
data decide the batch sharding). Each process writes
`<probe-out>/process-<i>.npz`, holding for every step probed and every
block of rows its devices hold the tokens and loss mask it built:
`tokens/<step>/<first row>` and `loss_mask/<step>/<first row>`. Nothing is
compiled.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np

import models
from zero_jax.config import flags
from zero_jax import job as job_lib
from zero_jax.runtime import cpu
from zero_jax.data import corpus as corpus_lib
from zero_jax.runtime import distributed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML run config; flags override it")
    parser.add_argument("--steps-to-probe", default="0", help="comma-separated steps")
    parser.add_argument("--probe-out", required=True, help="directory for process-<i>.npz")
    cpu.add_devices_flag(parser)
    flags.add_flags(parser)
    args = parser.parse_args(argv)
    try:
        cfg = flags.from_args(args, args.config)
        cpu.simulate(args.devices)  # both before anything asks JAX for devices
        distributed.initialize(cfg.distributed)
        corpus = corpus_lib.load(cfg.data.source)
        job = job_lib.prepare(cfg, models.for_run(cfg.model, corpus.vocab_size)[0])
    except (ValueError, FileNotFoundError, distributed.DistributedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t, out = cfg.train, {}
    for step in (int(s) for s in args.steps_to_probe.split(",")):
        batch = corpus_lib.global_batch(corpus, "train", cfg.data.seq_len, t.batch_size, t.seed,
                                      step, job.state_plan.batch_sharding, cfg.data.segment_ids)
        for name, array in batch.items():
            for shard in array.addressable_shards:
                out[f"{name}/{step}/{shard.index[0].start or 0}"] = np.asarray(shard.data)
    Path(args.probe_out).mkdir(parents=True, exist_ok=True)
    np.savez(Path(args.probe_out) / f"process-{jax.process_index()}.npz", **out)
    print(f"process {jax.process_index()}: {len(out)} blocks of rows written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
