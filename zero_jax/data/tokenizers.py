"""Tokenizers for prepared data (`zero-jax prepare-data`): the byte-level
default and Hugging Face `tokenizers` files, an end-of-document token after
every document, and conversations rendered with a loss mask on the
assistant's tokens.

Conversations are rendered with the model directory's chat template
(`chat_template` in tokenizer_config.json, a Jinja template, as
transformers applies it) where there is one, else with the plain template:

    ### User:\\n{content}\\n\\n### Assistant:\\n{content}<eos>\\n\\n

(one "### {Role}:" block per message). The loss covers the assistant's
content and the end-of-document token after it; with a chat template, each
assistant message's rendered span (what the template adds for it, its end
of turn included), found by rendering the conversation's prefixes.
Nothing here imports JAX: the tokenizer runs in worker processes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from zero_jax.data import token_files

BYTES = "bytes"
# Names Hugging Face tokenizers give their end-of-document token, tried in order
# when the directory's configs do not say.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
ROLES = ("system", "user", "assistant")
# The fields of a chat record messages_of reads: a table's columns of these names.
CHAT_FIELDS = ("messages", "prompt", "response", "system")


class TokenizerError(ValueError):
    """A tokenizer or a record that cannot be used; the message says which."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a worker needs to rebuild the tokenizer (picklable)."""

    name: str  # "bytes", or the path of a tokenizer.json
    vocab_size: int
    eos_id: int
    eos_token: str
    bos_token: str = ""
    chat_template: str = ""  # Jinja source; "" for the plain template
    sha256: str = ""  # of the tokenizer.json: data and model must share it


def _config(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(entry: Any) -> str:
    return entry.get("content", "") if isinstance(entry, dict) else (entry or "")


def resolve(name: str, eos_token: str = "") -> Spec:
    """The tokenizer `name`: "bytes" (ids are UTF-8 bytes, end of document
    256), a directory holding tokenizer.json, or that file itself."""
    if name == BYTES:
        return Spec(BYTES, 257, 256, "<eos>")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError(f"--tokenizer {name}: needs the tokenizers library: pip install "
                             "'zero-jax[data]' (or use --tokenizer bytes)") from None

    path = Path(name)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.exists():
        raise TokenizerError(f"--tokenizer {name}: no tokenizer.json there; give a model "
                             "directory with one, a tokenizer.json, or 'bytes'")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exceptions
        raise TokenizerError(f"--tokenizer {name}: {file} is not a Hugging Face tokenizer.json "
                             f"({str(e).splitlines()[0][:200]})") from None
    cfg = _config(file.parent)
    template = cfg.get("chat_template") or ""
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), "")
    eos = eos_token or _token_text(cfg.get("eos_token"))
    if not eos:
        eos = next((n for n in EOS_NAMES if tok.token_to_id(n) is not None), "")
    eos_id = tok.token_to_id(eos) if eos else None
    if eos_id is None:
        raise TokenizerError(f"--tokenizer {name}: no end-of-document token found (tried "
                             f"{eos or ', '.join(EOS_NAMES)}); name one with --eos-token")
    return Spec(str(file), tok.get_vocab_size(with_added_tokens=True), eos_id, eos,
                _token_text(cfg.get("bos_token")), template,
                token_files.file_sha256(file))


class Encoder:
    """Text and conversations -> token ids (and loss masks), in one process."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self._tok = None
        self._template = None
        if spec.name != BYTES:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(spec.name)
        if spec.chat_template:
            import jinja2.sandbox

            def fail(message):
                raise TokenizerError(f"the chat template refused a record: {message}")

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
                                                               lstrip_blocks=True)
            env.globals["raise_exception"] = fail
            self._template = env.from_string(spec.chat_template)

    def ids(self, text: str, special: bool = False) -> list[int]:
        """`text`'s ids; `special`: with the tokenizer's own added tokens (BOS)."""
        if self._tok is None:
            return list(text.encode("utf-8"))
        return self._tok.encode(text, add_special_tokens=special).ids

    def text(self, text: str, first: bool, last: bool) -> np.ndarray:
        """Ids of (a piece of) one document: the first piece with the
        tokenizer's special tokens, the last followed by the end of document."""
        if self._tok is None:
            ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint32)
        else:
            ids = np.asarray(self._tok.encode(text, add_special_tokens=first).ids, np.uint32)
        return np.append(ids, np.uint32(self.spec.eos_id)) if last else ids

    def chat(self, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, loss mask) of one conversation."""
        if self._template is None:
            ids, mask = self._plain(messages)
        else:
            ids, mask = self._templated(messages)
        if not ids or ids[-1] != self.spec.eos_id:  # documents end with it, as text does
            ids, mask = ids + [self.spec.eos_id], mask + [0]
        return np.asarray(ids, np.uint32), np.asarray(mask, np.uint8)

    def _plain(self, messages):
        ids: list[int] = []
        mask: list[int] = []

        def add(piece: list[int], target: bool):
            ids.extend(piece)
            mask.extend([int(target)] * len(piece))

        for i, m in enumerate(messages):
            add(self.ids(f"### {m['role'].capitalize()}:\n", special=i == 0), False)
            target = m["role"] == "assistant"
            add(self.ids(m["content"]), target)
            if target:
                add([self.spec.eos_id], True)
            add(self.ids("\n\n"), False)
        return ids, mask

    def _render(self, messages, generation_prompt: bool) -> str:
        return self._template.render(messages=messages, add_generation_prompt=generation_prompt,
                                     bos_token=self.spec.bos_token,
                                     eos_token=self.spec.eos_token)

    def _templated(self, messages):
        text = self._render(messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], True)
            through = self._render(messages[:i + 1], False)
            if not (through.startswith(before) and text.startswith(through)):
                raise TokenizerError(
                    "the chat template does not render a conversation's beginning as the "
                    "beginning of the whole, so the assistant's tokens cannot be found; use the "
                    "plain template (a tokenizer directory without chat_template)")
            spans.append((len(before), len(through)))
        enc = self._tok.encode(text, add_special_tokens=False)
        mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc.offsets]
        return list(enc.ids), mask


def messages_of(record: Any) -> list[dict[str, str]]:
    """A chat record's messages: {"messages": [{"role", "content"}, ...]} or
    {"prompt", "response"} (with an optional "system")."""
    if not isinstance(record, dict):
        raise TokenizerError("a chat record is a JSON object")
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "response" in record:
        messages = ([{"role": "system", "content": record["system"]}] if record.get("system")
                    else []) + [{"role": "user", "content": record["prompt"]},
                                {"role": "assistant", "content": record["response"]}]
    else:
        raise TokenizerError('a chat record has "messages", or "prompt" and "response"')
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            for m in messages):
        raise TokenizerError(f"every message is {{\"role\": one of {', '.join(ROLES)}, "
                             "\"content\": a string}")
    if not any(m["role"] == "assistant" for m in messages):
        raise TokenizerError("the record has no assistant message: nothing to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]
