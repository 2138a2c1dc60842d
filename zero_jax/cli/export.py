"""Export a sharded checkpoint's parameters as consolidated weights.

    zero-jax export --checkpoint-dir ckpt --out model.safetensors
    zero-jax export --checkpoint-dir ckpt --hf-dir hf-export   # Hugging Face layout
    zero-jax export --checkpoint-dir ckpt --step 200 --out m.safetensors --report-memory
    zero-jax export --checkpoint-dir lora-ckpt --peft-dir adapters/    # a LoRA run's

Reads one array (one layer of a stacked array) at a time straight from the
checkpoint's storage and writes it out before reading the next, so host
memory stays near the largest such piece, whatever the model's size. Every
array is verified against the checksum saved with it. Import the files back
with `zero-jax train --init-from`.

`--hf-dir` writes what `save_pretrained` writes for the model's architecture
(GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM):
config.json and the weights in files of at most `--max-shard-size` bytes
(5 GB, as save_pretrained), with model.safetensors.index.json when there
are several. It also carries the run's tokenizer (tokenizer.json and the
files beside it) from `--tokenizer`, else from the tokenizer the run's data
was prepared with (refused if that file's SHA-256 has changed since), else
from the directory the weights came from (`--model hf:DIR`, `--init-from`),
and says which in one line; for byte-level data, a TOKENIZER.md saying the
model reads UTF-8 bytes (checkpoint/tokenizer_files.py). The special tokens'
ids are the model's own where the tokenizer is a model's (config.json and
generation_config.json as that model's say them), else the data's end of
document and the tokenizer's own tokens; one line says which and why.

A LoRA run's checkpoint holds its adapters only: `--peft-dir DIR` writes
them as peft does (adapter_config.json, adapter_model.safetensors), and
`--hf-dir DIR --merge-lora` the model with them merged into the base they
were trained on (read where the checkpoint names it, checked by its digest).

A DeepSeek-V3 model's multi-token prediction modules, which transformers
has no place for, are left out unless `--with-mtp` is given: then module k
is layer n_layer + k as in DeepSeek's files, counted by config.json's
`num_nextn_predict_layers` (`--model hf:DIR --mtp-depth K` reads it back).

`--dtype bfloat16|float16|float32` is the dtype written; by default, the
one the model was trained to hold (`default_dtype`): a float32-trained model
is never narrowed unless asked, and a narrowing is said in one line.
float16 (for GPUs without bfloat16, such as V100 and T4) holds nothing
above 65504: a parameter with larger values is refused, naming it, and
nothing is left written.

Nothing the user had is deleted or replaced unasked: an existing `--out`
or a non-empty `--hf-dir` is refused before anything is read, unless
`--overwrite` is given. Every output is written under a temporary name
beside its destination (`.NAME.partial-PID`) and renamed into place only
once all are complete, so a refusal half-way leaves the previous files as
they were; a directory replaced is swapped by renames (the old one moved
aside, the new one renamed in, the old one removed), never left
half-written under the user's name.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable

import models
from models import lora_merge
from models.common import hf_files
from zero_jax.checkpoint import export
from zero_jax.checkpoint import manager as manager_lib
from zero_jax.checkpoint import tokenizer_files
from zero_jax.cli import staged as staged_lib
from zero_jax.runtime import procmem

DTYPES = ("bfloat16", "float16", "float32")  # what --dtype writes (Hugging Face's torch_dtype)
# What each 16-bit dtype is narrower than: fewer bits, or (float16 from bfloat16) less range.
NARROWER_THAN = {"bfloat16": {"float32", "float64", "float16"},
                 "float16": {"float32", "float64", "bfloat16"}}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", required=True, help="the run's --checkpoint-dir")
    parser.add_argument("--step", type=int, help="default: the newest complete checkpoint")
    parser.add_argument("--out", help="consolidated .safetensors file to write")
    parser.add_argument("--hf-dir", help="directory for a Hugging Face export")
    parser.add_argument("--max-shard-size", type=float, default=hf_files.MAX_SHARD_BYTES,
                        help="bytes per safetensors file of the Hugging Face export")
    parser.add_argument("--tokenizer",
                        help="tokenizer files to copy into --hf-dir (a directory with "
                             "tokenizer.json, or a tokenizer.json); default: those of the run's "
                             "data, else of its --init-from directory")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="dtype of the weights written; default: the one the model was "
                             "trained to hold (bfloat16 for a Hugging Face export of a bf16 run)")
    parser.add_argument("--peft-dir",
                        help="directory for a LoRA checkpoint's adapters in peft's layout "
                             "(adapter_config.json, adapter_model.safetensors)")
    parser.add_argument("--merge-lora", action="store_true",
                        help="with --hf-dir, a LoRA checkpoint's adapters merged into the "
                             "weights of the base they were trained on (read where its "
                             "checkpoint names it, checked by its digest)")
    parser.add_argument("--with-mtp", action="store_true",
                        help="also write a DeepSeek-V3 model's multi-token prediction modules "
                             "into --hf-dir, as DeepSeek's files hold them (layer n_layer + k; "
                             "transformers ignores them, vLLM reads them); default: left out")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out file or a non-empty --hf-dir (each "
                             "swapped in whole once the export is complete)")
    parser.add_argument("--report-memory", action="store_true",
                        help="print the peak resident memory the export added, as JSON")
    return parser.parse_args(argv)


def default_dtype(stored: set[str], precision: dict | None, hf_layout: bool) -> str:
    """The dtype the model was trained to hold, from its stored parameters'
    dtypes and the run's precision policy (checkpoint meta):

        stored bfloat16 (--param-dtype bfloat16)             bfloat16
        float32 masters, computed in bfloat16 (--precision    bfloat16 for a Hugging Face
          bf16): the model the run trained is the bf16 one    export, float32 (the masters,
                                                              lossless) for --out
        anything else (an fp32 run)                           float32
    """
    if stored == {"bfloat16"}:
        return "bfloat16"
    if hf_layout and (precision or {}).get("compute") == "bfloat16":
        return "bfloat16"
    return "float32"


def narrowings(stored: set[str], dtypes: dict[str, str], asked: bool) -> list[str]:
    """One line per output written in fewer bits than the parameters are
    stored in: a float32-trained model is never narrowed silently."""
    flags = {"out": "--out", "hf": "--hf-dir"}
    why = "as --dtype asked" if asked else "the dtype the run computed in"
    return [f"{flags[what]}: parameters stored in {', '.join(sorted(stored))} written in "
            f"{dtype} ({why}); --dtype float32 keeps every bit"
            for what, dtype in dtypes.items()
            if stored & NARROWER_THAN.get(dtype, set())]


def output_dtypes(args: argparse.Namespace, reader: export.ParamReader) -> dict[str, str]:
    """What each output asked for is written in: --dtype, else its default."""
    stored, precision = reader.stored_dtypes(), reader.meta.get("precision")
    out = {what: args.dtype or default_dtype(stored, precision, what == "hf")
           for what, given in (("out", args.out), ("hf", args.hf_dir)) if given}
    return {**out, **({"peft": args.dtype or "float32"} if args.peft_dir else {})}


def tokenizer_for(args: argparse.Namespace, meta: dict) -> tokenizer_files.Export | None:
    """What a Hugging Face export carries of the run's tokenizer, checked
    against what --hf-dir already holds (None for no Hugging Face export)."""
    if not args.hf_dir:
        return None
    init_from = meta.get("run", {}).get("checkpoint", {}).get("init_from", "")
    dirs = models.weight_dirs(meta.get("model", {}).get("name", ""), init_from)
    return tokenizer_files.for_run(meta, dirs, args.tokenizer)


def special_ids(cfg, tokenizer: tokenizer_files.Export | None) -> tuple[dict, dict, str]:
    """(config.json's special tokens' ids, generation_config.json, the line
    saying which were written and why) of a Hugging Face export. config.json
    names the ids as models.hf_config_json writes them; generation_config.json
    is the model's own where the tokenizer's model has one, else those ids."""
    given = tokenizer.token_ids if tokenizer else {}
    written = models.hf_config_json(cfg, token_ids=given)
    ids = {k: written[k] for k in tokenizer_files.IDS if k in written}
    generation = {**{k: v for k, v in ids.items() if v is not None},
                  **(tokenizer.generation if tokenizer else {})}
    known = ", ".join(f"{k} {v}" for k, v in ids.items() if v is not None)
    home = tokenizer.ids_from if tokenizer else None
    where = (f"in config.json, {tokenizer_files.GENERATION} as {home}'s" if home else
             f"in config.json and {tokenizer_files.GENERATION}")
    if not generation:
        known, where = "none known", f"(null in config.json, no {tokenizer_files.GENERATION})"
    why = tokenizer.ids_why if tokenizer else ""
    if "bos_token_id" not in given and ids.get("bos_token_id") is not None:
        why += "; bos is eos, as GPT-2 begins text with its end-of-text token"
    return ids, generation, f"token ids: {known} {where}: {why}"


def write(args: argparse.Namespace, reader: export.ParamReader, step: int,
          directory: Path, dtype: dict[str, str],
          tokenizer: tokenizer_files.Export | None = None,
          staged: staged_lib.Staged | None = None,
          merged: Callable | None = None) -> tuple[list[Path], list[str]]:
    """Every file asked for, written in its dtype under temporary names, then
    renamed into place together; on a failure, the temporaries are removed
    and the destinations are as they were. Returns the weights' files and
    notes of anything left behind. `merged`: --merge-lora's reader."""
    staged = staged or staged_lib.Staged()
    written = []
    try:
        if args.out:
            out = staged.file(args.out)
            export.write_safetensors(out, reader.consolidated(dtype["out"]),
                                     {"step": str(step), "source": str(directory)})
            written.append(Path(args.out))
        if args.peft_dir:
            written += [Path(args.peft_dir) / p.name for p in models.save_peft(
                staged.directory(args.peft_dir), reader.meta, reader.arrays, reader.read,
                dtype["peft"])]
        if args.hf_dir:
            out = staged.directory(args.hf_dir)
            cfg = models.hf_export_config(reader.meta["model"], args.with_mtp)
            read = merged or reader.read
            written += [Path(args.hf_dir) / p.name
                        for p in models.save_hf(out, cfg, read, int(args.max_shard_size),
                                                dtype["hf"],
                                                tokenizer.token_ids if tokenizer else None)]
            if tokenizer:
                tokenizer_files.write(tokenizer, out)
            generation = special_ids(cfg, tokenizer)[1]
            if generation:
                (out / tokenizer_files.GENERATION).write_text(json.dumps(generation, indent=1))
    except BaseException:  # a refusal, a full disk, an interrupt: nothing of this export stays
        staged.discard()
        raise
    try:
        notes = staged.commit()
    except OSError:
        staged.discard()
        raise
    return written, notes


def failed(e: Exception, staged: staged_lib.Staged, kept: list[str]) -> int:
    """A failed write as one line: exit 4 for a corrupt checkpoint, else 2;
    `kept`, the destinations that existed before, are said to be untouched."""
    corrupt = isinstance(e, manager_lib.CorruptCheckpoint)
    said = corrupt or isinstance(e, export.OutOfRange)  # their messages name the array
    what = e if said else f"writing {staged.writing or e.filename}: {e.strerror}"
    kept = [p for p in kept if staged_lib.real(p) not in staged.committed]
    left = f", {' and '.join(kept)} left as {'it was' if len(kept) == 1 else 'they were'}"
    done = (f"only {' and '.join(map(str, staged.committed))} written" if staged.committed
            else "nothing written")
    print(f"error: {what}; {done}{left if kept else ''}", file=sys.stderr)
    return 4 if corrupt else 2


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    directory = Path(args.checkpoint_dir)
    try:
        check_outputs(args.out, args.hf_dir, args.max_shard_size, args.tokenizer,
                      args.overwrite, args.with_mtp, args.peft_dir, args.merge_lora)
        step = choose_step(directory, args.step)
        reader = export.ParamReader(directory / str(step))
        lora_checkpoint(reader.meta, directory / str(step), args)
        tokenizer = tokenizer_for(args, reader.meta)
        if args.hf_dir:  # a model its architecture cannot express is refused before any write
            models.hf_config_json(models.hf_export_config(reader.meta["model"], args.with_mtp))
        merged = None  # the base read and checked before anything is written
        if args.merge_lora:
            merged = lora_merge.merged(reader.meta, models.config_from(reader.meta["model"]),
                                       reader.read)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except manager_lib.CorruptCheckpoint as e:
        print(f"error: {e}; nothing written", file=sys.stderr)
        return 4
    dtype = output_dtypes(args, reader)
    kept = [p for p in (args.out, args.hf_dir, args.peft_dir) if p and Path(p).exists()]
    baseline = procmem.reset_peak()  # measure from here
    staged = staged_lib.Staged()
    try:
        written, notes = write(args, reader, step, directory, dtype, tokenizer, staged, merged)
    # OSError: no space, no permission; OutOfRange: a value float16 cannot hold
    except (manager_lib.CorruptCheckpoint, export.OutOfRange, OSError) as e:
        return failed(e, staged, kept)
    print(describe(written, step, directory))
    for note in notes:
        print(note)
    if tokenizer:
        print(tokenizer.line)
        print(special_ids(models.config_from(reader.meta["model"]), tokenizer)[2])
    for line in narrowings(reader.stored_dtypes(), dtype, asked=bool(args.dtype)):
        print(line)
    depth = getattr(models.config_from(reader.meta["model"]), "mtp_depth", 0)
    if args.hf_dir and depth and not args.with_mtp:
        print(f"--hf-dir: the model's {depth} multi-token prediction module(s) left out, as "
              "transformers has no place for them; --with-mtp writes them as DeepSeek's files do")
    if args.report_memory:
        print(json.dumps({"peak_added_bytes": procmem.resident("VmHWM") - baseline,
                          "largest_piece_bytes": reader.largest_piece_bytes(),
                          "param_bytes": reader.total_bytes()}))
    return 0


def lora_checkpoint(meta: dict, where: Path, args: argparse.Namespace) -> None:
    """A LoRA checkpoint holds adapters only: they go to --peft-dir, and
    --peft-dir takes nothing else."""
    rank = meta.get("run", {}).get("lora", {}).get("rank")
    if rank and (args.out or (args.hf_dir and not args.merge_lora)):
        raise ValueError(f"{where} holds LoRA adapters only (--lora-rank {rank}), not a "
                         "model: export them with --peft-dir DIR, or merged into their base "
                         "with --hf-dir DIR --merge-lora")
    if (args.peft_dir or args.merge_lora) and not rank:
        flag = "--peft-dir" if args.peft_dir else "--merge-lora"
        raise ValueError(f"{flag}: {where} is not a LoRA run's checkpoint (no adapters); use "
                         "--out or --hf-dir")


def check_outputs(out: str | None, hf_dir: str | None, max_shard_size: float,
                  tokenizer: str | None = None, overwrite: bool = False,
                  with_mtp: bool = False, peft_dir: str | None = None,
                  merge_lora: bool = False) -> None:
    """What the export would write, checked before anything is read: nothing
    the user has is replaced unless `overwrite`."""
    if not (out or hf_dir or peft_dir):
        raise ValueError("nothing to write: give --out FILE (one .safetensors file), "
                         "--hf-dir DIR (the Hugging Face layout) or --peft-dir DIR (a LoRA "
                         "run's adapters)")
    if tokenizer and not hf_dir:
        raise ValueError(f"--tokenizer {tokenizer}: only a Hugging Face export carries a "
                         "tokenizer; add --hf-dir DIR")
    if merge_lora and not hf_dir:
        raise ValueError("--merge-lora: the merged weights are written in Hugging Face's "
                         "layout; add --hf-dir DIR")
    if with_mtp and not hf_dir:
        raise ValueError("--with-mtp: only a Hugging Face export leaves the multi-token "
                         "prediction modules out (--out writes every parameter); add --hf-dir DIR")
    if out and not Path(out).parent.is_dir():
        raise ValueError(f"--out {out}: the directory {Path(out).parent} does not exist; "
                         "create it first")
    if out and Path(out).is_dir():
        raise ValueError(f"--out {out}: is a directory; give a file name (model.safetensors)")
    real = staged_lib.real
    if out and hf_dir and (real(hf_dir) == real(out) or real(hf_dir) in real(out).parents):
        raise ValueError(f"--out {out}: inside --hf-dir {hf_dir}, which the export writes "
                         "whole; give a file name outside it")
    if out and Path(out).exists() and not overwrite:
        raise ValueError(f"--out {out}: already exists; give --overwrite to replace it, or "
                         "another file name")
    for flag, directory in (("--hf-dir", hf_dir), ("--peft-dir", peft_dir)):
        _check_directory(flag, directory, overwrite)
    if hf_dir and not (max_shard_size >= 1 and math.isfinite(max_shard_size)):
        raise ValueError(f"--max-shard-size {max_shard_size:g}: must be a number of bytes >= 1 "
                         f"(default {hf_files.MAX_SHARD_BYTES:g}, as save_pretrained)")


def _check_directory(flag: str, directory: str | None, overwrite: bool) -> None:
    """A directory output: a directory, and empty unless `overwrite`."""
    if not directory:
        return
    if Path(directory).exists() and not Path(directory).is_dir():
        raise ValueError(f"{flag} {directory}: exists and is not a directory")
    try:
        held = sorted(p.name for p in Path(directory).iterdir()) if Path(directory).is_dir() \
            else []
    except OSError as e:
        raise ValueError(f"{flag} {directory}: cannot be read ({e.strerror})") from None
    if held and not overwrite:
        listed = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ValueError(f"{flag} {directory}: already holds {listed}; give --overwrite to "
                         "replace the directory, or export into another")


def choose_step(directory: Path, step: int | None) -> int:
    """The checkpoint step to export: `step`, else the newest complete one."""
    if not directory.is_dir():
        raise ValueError(f"--checkpoint-dir {directory}: no such directory")
    steps = manager_lib.complete_steps(directory)
    if not steps:
        never = manager_lib.incomplete(directory)
        raise ValueError(f"--checkpoint-dir {directory}: no complete checkpoint there"
                         + (f" (saves that never committed: {', '.join(never)})" if never else "")
                         + "; give the directory a run saved into (zero-jax train --checkpoint-dir)")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ValueError(f"--step {step}: no complete checkpoint of that step in {directory}; "
                         f"complete steps: {', '.join(map(str, steps))}")
    return step


def describe(written: list[Path], step: int, directory: Path) -> str:
    """One line: the files written, their tensors, dtypes and bytes, and the source."""
    files = [export.SafetensorsFile(p) for p in written if p.suffix == ".safetensors"]
    tensors = sum(len(f.keys()) for f in files)
    kinds = sorted({f.dtype(name) for f in files for name in f.keys()})
    size = sum(f.path.stat().st_size for f in files)
    return (f"wrote {', '.join(map(str, written))}: {tensors} tensors ({', '.join(kinds)}), "
            f"{size:,} bytes, from checkpoint step {step} of {directory}")
