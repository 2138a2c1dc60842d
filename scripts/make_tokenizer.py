"""Train a byte-level BPE tokenizer (Hugging Face `tokenizers`) on the
standard library corpus, for tests and benchmarks where no hub is reachable.

    python scripts/make_tokenizer.py --out tok/ --vocab-size 8192
    python scripts/make_tokenizer.py --out tok/ --chat-template   # adds a ChatML template

Writes tok/tokenizer.json and tok/tokenizer_config.json (end of document
`<|endoftext|>`; with --chat-template, ChatML's `<|im_start|>`/`<|im_end|>`
and its template), what a model directory on the hub holds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from zero_jax.data import corpus as corpus_lib

EOS = "<|endoftext|>"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def train(vocab_size: int, sample_bytes: int, chat: bool) -> Tokenizer:
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--vocab-size", type=int, default=8192, help="tokens, special ones included")
    p.add_argument("--sample-mb", type=float, default=4.0, help="MB of the corpus to train on")
    p.add_argument("--chat-template", action="store_true", help="add ChatML tokens and template")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train(args.vocab_size, int(args.sample_mb * 1e6), args.chat_template)
    tok.save(str(out / "tokenizer.json"))
    config = {"eos_token": EOS, **({"chat_template": CHATML} if args.chat_template else {})}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    print(f"wrote {out}: byte-level BPE, {tok.get_vocab_size()} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
