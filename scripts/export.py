"""Export a sharded checkpoint's parameters as consolidated weights.

    python scripts/export.py --checkpoint-dir ckpt --out model.safetensors
    python scripts/export.py --checkpoint-dir ckpt --hf-dir hf-export   # Hugging Face layout
    python scripts/export.py --checkpoint-dir ckpt --step 200 --out m.safetensors --report-memory

Reads one array (one layer of a stacked array) at a time straight from the
checkpoint's storage and writes it out before reading the next, so host memory
stays near the largest such piece, whatever the model's size. Every array is
verified against the checksum saved with it. Import the files back with
`scripts/train.py --init-from`.

`--hf-dir` writes what `save_pretrained` writes for the model's architecture
(GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM):
config.json and the weights in files of at most `--max-shard-size` bytes
(5 GB, as save_pretrained), with model.safetensors.index.json when there
are several.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import models
import procmem
from models import hf
from zero_jax import checkpoint as ckpt_lib
from zero_jax import export


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--step", type=int, help="default: the newest complete checkpoint")
    parser.add_argument("--out", help="consolidated .safetensors file to write")
    parser.add_argument("--hf-dir", help="directory for a Hugging Face export")
    parser.add_argument("--max-shard-size", type=float, default=hf.MAX_SHARD_BYTES,
                        help="bytes per safetensors file of the Hugging Face export")
    parser.add_argument("--report-memory", action="store_true",
                        help="print the peak resident memory the export added, as JSON")
    args = parser.parse_args(argv)
    if not (args.out or args.hf_dir):
        parser.error("give --out and/or --hf-dir")

    directory = Path(args.checkpoint_dir)
    steps = ckpt_lib.complete_steps(directory)
    step = args.step if args.step is not None else (steps[-1] if steps else None)
    if step not in steps:
        print(f"error: no complete checkpoint {'' if step is None else step} in {directory} "
              f"(complete steps: {steps})", file=sys.stderr)
        return 2
    reader = export.ParamReader(directory / str(step))

    baseline = procmem.reset_peak()  # measure from here
    written = []
    try:
        if args.out:
            export.write_safetensors(args.out, reader.consolidated(),
                                     {"step": str(step), "source": str(directory)})
            written.append(Path(args.out))
        if args.hf_dir:
            cfg = models.config_from(reader.meta["model"])
            written += hf.save(Path(args.hf_dir), cfg, reader.read, int(args.max_shard_size))
    except export.CorruptCheckpoint as e:
        for path in written + [Path(p) for p in (args.out,) if p]:
            path.unlink(missing_ok=True)
        print(f"error: {e}; nothing written", file=sys.stderr)
        return 4
    if args.report_memory:
        print(json.dumps({"peak_added_bytes": procmem.resident("VmHWM") - baseline,
                          "largest_piece_bytes": reader.largest_piece_bytes(),
                          "param_bytes": reader.total_bytes()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
