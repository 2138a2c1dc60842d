"""A byte-level BPE tokenizer (Hugging Face `tokenizers`) trained on the
standard library corpus, for tests and benchmarks where no hub is reachable.

`write` saves what a model directory on the hub holds: tokenizer.json and
tokenizer_config.json (end of document `<|endoftext|>`; with `chat`,
ChatML's `<|im_start|>`/`<|im_end|>` and its template).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from zero_jax.data import corpus as corpus_lib

EOS = "<|endoftext|>"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def train(vocab_size: int, sample_bytes: int, chat: bool) -> Tokenizer:
    """A tokenizer of `vocab_size` tokens (special ones included),
    trained on the first `sample_bytes` of the corpus."""
    # Imported here: an optional dependency (zero-jax[data]).
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = corpus_lib.stdlib_corpus().train[0].tokens[:sample_bytes]
    text = bytes(corpus).decode("utf-8", errors="replace")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [EOS] + (["<|im_start|>", "<|im_end|>"] if chat else [])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lines = text.splitlines(keepends=True)
    tok.train_from_iterator((("".join(lines[i:i + 1000])) for i in range(0, len(lines), 1000)),
                            trainer)
    return tok


def write(out: Path, vocab_size: int, sample_bytes: int, chat: bool = False) -> Tokenizer:
    """Train a tokenizer and write it into the directory `out` (made if missing)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = train(vocab_size, sample_bytes, chat)
    tok.save(str(out / "tokenizer.json"))
    config = {"eos_token": EOS, **({"chat_template": CHATML} if chat else {})}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return tok
