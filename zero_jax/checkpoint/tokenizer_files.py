"""The tokenizer a Hugging Face export carries (`zero-jax export --hf-dir`).

Taken, in order, from: `--tokenizer`; the tokenizer the run's data was
prepared with (the checkpoint records its path and SHA-256, as does the
data's meta.json); the directory the run's weights came from (`--model
hf:DIR`, `--init-from DIR`). A file taken by default must still have the
SHA-256 the data was prepared with: a changed one is refused, never
exported as the model's. Byte-level data has no tokenizer file; the export
carries a note (TOKENIZER.md) saying how the model reads text instead.

The special tokens' ids (config.json, generation_config.json) are those of
the model whose tokenizer this is: a directory the run's weights came from
holding the same tokenizer.json beside its config.json, else the
tokenizer's own directory if it holds one. Without such a model, they are
the data's end-of-document id and the tokens tokenizer_config.json names.

A tokenizer_config.json without `tokenizer_class` gets PreTrainedTokenizerFast:
without it, transformers picks the architecture's own class (GPT2Tokenizer
for GPT-2), which rebuilds the pipeline from vocabulary and merges and can
split text otherwise than tokenizer.json does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from zero_jax.data import corpus as corpus_lib
from zero_jax.data import token_files
from zero_jax.data import tokenizers as tokenizers_lib

TOKENIZER = "tokenizer.json"
CONFIG = "tokenizer_config.json"
# Copied from beside tokenizer.json where present (generation_config.json is the model's).
BESIDE = (CONFIG, "special_tokens_map.json", "vocab.json", "merges.txt")
NOTE = "TOKENIZER.md"
GENERATION = "generation_config.json"
IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # what config.json says of the tokens
BOOKKEEPING = ("_from_model_config", "transformers_version")  # a writer's, not the model's
FAST = "PreTrainedTokenizerFast"  # loads tokenizer.json as it is, whatever the architecture
SHORT = 12  # hex digits of a SHA-256 in the line printed


@dataclasses.dataclass(frozen=True)
class Export:
    """What the export writes beside the weights (file name -> bytes), and the line saying so."""

    files: dict[str, bytes]
    line: str
    # What config.json says of the special tokens (models.hf_config_json): those of
    # the model whose tokenizer this is (model_ids), else the data's
    # end-of-document id and the tokenizer's own tokens; {} where nothing is known.
    token_ids: dict[str, Any] = dataclasses.field(default_factory=dict)
    # That model's generation_config.json (the writer's bookkeeping left
    # out), the data's end of document added to its eos where missing; {}
    # where there is none: generation_config.json is then made of token_ids.
    generation: dict[str, Any] = dataclasses.field(default_factory=dict)
    ids_from: Path | None = None  # the model directory `generation` is from
    ids_why: str = ""  # where the ids come from, for the line saying which were written


@dataclasses.dataclass(frozen=True)
class Recorded:
    """The run's tokenizer, as its checkpoint and data record it."""

    source: str  # the run's --data
    name: str  # "bytes", the path of a tokenizer.json, or "" when none is known
    sha256: str  # of that tokenizer.json ("" when not recorded)
    eos_id: int | None  # the data's end-of-document id, where known


def recorded(meta: dict[str, Any]) -> Recorded:
    """The tokenizer of the run whose checkpoint meta is `meta`: the one the
    checkpoint records, else the one its data directory's meta.json names."""
    source = meta.get("data", {}).get("source") or meta.get("run", {}).get("data", {}).get(
        "source", "")
    if source == corpus_lib.STDLIB:  # read as bytes, without end-of-document tokens
        return Recorded(source, tokenizers_lib.BYTES, "", None)
    data = _data_meta(source)
    tok = meta.get("data", {}).get("tokenizer") or data.get("tokenizer") or {}
    same = data.get("tokenizer", {}).get("sha256") == tok.get("sha256")
    eos = data.get("eos_id") if same else None
    return Recorded(source, tok.get("name", ""), tok.get("sha256", ""), eos)


def _data_meta(source: str) -> dict[str, Any]:
    """The data directory's meta.json, or {} where it is gone (or a flat file)."""
    if not source or not Path(source).is_dir():
        return {}
    try:
        return token_files.read_meta(Path(source))
    except (token_files.DataError, OSError):
        return {}


def for_run(meta: dict[str, Any], model_dirs: list[str], given: str | None = None) -> Export:
    """What to export for the run of checkpoint `meta`; `model_dirs` are the
    directories its weights came from, `given` the --tokenizer asked for."""
    run = recorded(meta)
    if given:
        file = _tokenizer_file(Path(given))
        if file is None:
            raise ValueError(f"--tokenizer {given}: no {TOKENIZER} there; give a directory "
                             f"holding one, or the {TOKENIZER} itself")
        data = file.read_bytes()
        have = hashlib.sha256(data).hexdigest()
        other = bool(run.sha256) and run.sha256 != have
        whose = "as --tokenizer asked" + (
            f"; the data was prepared with SHA-256 {run.sha256[:SHORT]}..." if other else "")
        return _copied(file, data, have, whose, None if other else run.eos_id, run, model_dirs)
    if run.name == tokenizers_lib.BYTES:
        return _byte_note(run)
    candidates = ([(Path(run.name), "the data's")] if run.name else []) + [
        (Path(d) / TOKENIZER, "the data's" if run.sha256 else "of the weights' directory")
        for d in model_dirs]
    for file, whose in candidates:
        if file.is_file():
            data = file.read_bytes()
            have = hashlib.sha256(data).hexdigest()
            if run.sha256 and have != run.sha256:
                raise ValueError(_changed(file, have, run))
            return _copied(file, data, have, whose, run.eos_id, run, model_dirs)
    return Export({}, f"tokenizer: none exported ({_why_none(run, model_dirs)}); add one with "
                      f"--tokenizer DIR (a directory holding {TOKENIZER}, or the file)",
                  ids_why="no tokenizer to take them from")


def _changed(file: Path, have: str, run: Recorded) -> str:
    """The refusal of a tokenizer.json that is not the one the data was prepared with."""
    what = ("that file changed since" if str(file) == run.name
            else f"the data was prepared with {run.name or 'another'}")
    return (f"{file}: SHA-256 {have}, but the run's data ({run.source}) was prepared with a "
            f"tokenizer of SHA-256 {run.sha256} ({what}); give the tokenizer the data was "
            "prepared with: --tokenizer DIR")


def _why_none(run: Recorded, model_dirs: list[str]) -> str:
    if run.name:
        reason = f"the data's tokenizer {run.name} is no longer there"
    elif _data_meta(run.source):
        reason = f"the data {run.source} names no tokenizer"
    elif run.source and Path(run.source).is_file():
        reason = f"the data {run.source} is a flat token file, which names no tokenizer"
    else:
        reason = f"the data {run.source or '(not recorded)'} is not there to say which"
    return reason + (f"; no {TOKENIZER} in {', '.join(model_dirs)}" if model_dirs else "")


def _tokenizer_file(path: Path) -> Path | None:
    file = path / TOKENIZER if path.is_dir() else path
    return file if file.is_file() else None


def _copied(file: Path, data: bytes, sha256: str, whose: str, eos_id: int | None,
            run: Recorded, model_dirs: list[str]) -> Export:
    """tokenizer.json and the files beside it; a tokenizer_config.json made
    or completed so that AutoTokenizer reads tokenizer.json as it is; the
    special tokens' ids (model_ids)."""
    files = {TOKENIZER: data}
    files.update({name: (file.parent / name).read_bytes() for name in BESIDE
                  if (file.parent / name).is_file()})
    copied = ", ".join(files)
    line = f"tokenizer: copied {copied} from {file.parent} (SHA-256 {sha256[:SHORT]}..., {whose})"
    if CONFIG not in files:
        config = {"tokenizer_class": FAST}
        eos = eos_token(_object(data) or {}, eos_id)
        config.update({"eos_token": eos} if eos else {})
        files[CONFIG] = _json(config)
        line += f"; wrote {CONFIG} ({FAST}{f', eos_token {eos}' if eos else ''})"
    else:
        config = _object(files[CONFIG])
        if config is not None and "tokenizer_class" not in config:
            files[CONFIG] = _json({"tokenizer_class": FAST, **config})
            line += f"; gave {CONFIG} tokenizer_class {FAST} (it had none)"
    home = _model_home(file, sha256, model_dirs)
    if home is None:  # no model's ids: the data's end of document, the tokenizer's own tokens
        tokens = _token_ids(_object(data) or {}, _object(files[CONFIG]) or {})
        ids = {**tokens, **({} if eos_id is None else {"eos_token_id": eos_id})}
        why = (("the data's end of document" if eos_id is not None else
                f"{CONFIG}'s tokens") + f" (its tokenizer's directory {file.parent} holds no "
               "model's config.json to take a model's ids from)")
        return Export(files, line, ids, ids_why=why)
    ids, generation = _model_ids(home), _generation(home)
    if run.sha256 == sha256:
        whose = "the model's own" if home in map(Path, model_dirs) else f"those of {home}"
        why = f"{whose}, whose tokenizer the data was prepared with"
    elif run.sha256:
        why = (f"those of {home}, whose tokenizer --tokenizer gave; the data was prepared "
               "with another")
    else:
        data = run.source or "not recorded"
        why = (f"those of {home}, whose tokenizer this is; the data ({data}) names no "
               "tokenizer to confirm them")
    if eos_id is not None:
        eos = generation.get("eos_token_id", ids.get("eos_token_id"))
        theirs = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if not theirs:
            ids = {**ids, "eos_token_id": eos_id}
            why += "; eos the data's end of document, as the model names none"
        elif eos_id not in theirs:
            generation = {**generation, "eos_token_id": [*theirs, eos_id]}
            why += (f"; the data's end of document, {eos_id}, is not among the model's: added "
                    f"to {GENERATION}'s eos_token_id")
    return Export(files, line, ids, generation, home if generation else None, why)


def _model_home(file: Path, sha256: str, model_dirs: list[str]) -> Path | None:
    """The directory of the model whose tokenizer `file` is: a directory the
    run's weights came from holding the same tokenizer.json beside its
    config.json, else the tokenizer's own directory if it holds a config.json."""
    for d in map(Path, model_dirs):
        theirs = d / TOKENIZER
        if (d / "config.json").is_file() and theirs.is_file() and (
                theirs == file or token_files.file_sha256(theirs) == sha256):
            return d
    return file.parent if (file.parent / "config.json").is_file() else None


def _model_ids(directory: Path) -> dict[str, Any]:
    """The special tokens' ids of the model in `directory` (its config.json,
    as Hugging Face writes it), where given."""
    config = _read_json(directory / "config.json")
    return {k: config[k] for k in IDS if config.get(k) is not None}


def _generation(directory: Path) -> dict[str, Any]:
    """The model's generation_config.json, less the writer's bookkeeping ({} where none)."""
    return {k: v for k, v in _read_json(directory / GENERATION).items() if k not in BOOKKEEPING}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _token_ids(tokenizer: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The ids of the bos, eos and pad tokens tokenizer_config.json names, in
    tokenizer.json's vocabulary."""
    ids = _vocabulary(tokenizer)
    out = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("pad_token", "pad_token_id")):
        text = config.get(name)
        text = text.get("content") if isinstance(text, dict) else text
        if isinstance(text, str) and text in ids:
            out[key] = ids[text]
    return out


def _vocabulary(tokenizer: dict[str, Any]) -> dict[str, int]:
    """Token text -> id: the model's vocabulary and the added tokens."""
    vocab = tokenizer.get("model", {}).get("vocab")
    if isinstance(vocab, list):  # Unigram: [piece, score] pairs, the id their place
        vocab = {entry[0]: i for i, entry in enumerate(vocab) if isinstance(entry, list) and entry}
    out = dict(vocab) if isinstance(vocab, dict) else {}
    out.update({t.get("content", ""): t.get("id") for t in tokenizer.get("added_tokens", [])})
    return out


def eos_token(tokenizer: dict[str, Any], eos_id: int | None) -> str:
    """The text of the end-of-document token: id `eos_id`, else the first of
    the usual names the tokenizer has ("" when none)."""
    added = {t.get("id"): t.get("content", "") for t in tokenizer.get("added_tokens", [])}
    vocab = tokenizer.get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        added = {**{i: t for t, i in vocab.items()}, **added}
    if eos_id is not None:
        return added.get(eos_id, "")
    return next((n for n in tokenizers_lib.EOS_NAMES if n in added.values()), "")


def _object(raw: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None  # copied as it is: transformers says what is wrong with it
    return value if isinstance(value, dict) else None


def _json(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode()


def _byte_note(run: Recorded) -> Export:
    """TOKENIZER.md for a model that reads UTF-8 bytes."""
    if run.source == corpus_lib.STDLIB:
        eos = None
    else:  # prepared byte-level data: 256, unless its meta.json says otherwise
        eos = tokenizers_lib.resolve(tokenizers_lib.BYTES).eos_id if run.eos_id is None else run.eos_id
    if eos is None:
        end = ("there is no end-of-document id: the run's data, the Python standard "
               "library's source files, had none")
        said = "no end-of-document id"
    else:
        end = f"{eos} is the end-of-document id, which follows every document"
        said = f"end of document {eos}"
    text = (f"# Tokenizer\n\nThis model reads UTF-8 bytes: the ids 0-255 are the bytes of "
            f"the text, in order, and {end}. There is no tokenizer file to load: in Python, "
            '`list(text.encode("utf-8"))` gives a text\'s ids, and '
            '`bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")` the text '
            f"of ids.\n\nThe run read {run.source}.\n")
    why = ("the byte-level data's end of document" if eos is not None else
           f"the data, {run.source}, had no end-of-document id")
    return Export({NOTE: text.encode()},
                  f"tokenizer: none, the model reads UTF-8 bytes (ids 0-255, {said}); wrote "
                  f"{NOTE} saying so", {} if eos is None else {"eos_token_id": eos},
                  ids_why=why)


def write(export: Export, out: Path) -> list[Path]:
    """The files written; on a failure, those written are removed."""
    written = []
    try:
        for name, data in export.files.items():
            written.append(out / name)
            (out / name).write_bytes(data)
    except OSError:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return written
