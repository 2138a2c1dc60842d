"""Train a byte-level BPE tokenizer (Hugging Face `tokenizers`) on the
standard library corpus, for tests and benchmarks where no hub is reachable.

    python scripts/make_tokenizer.py --out tok/ --vocab-size 8192
    python scripts/make_tokenizer.py --out tok/ --chat-template   # adds a ChatML template

Writes tok/tokenizer.json and tok/tokenizer_config.json (end of document
`<|endoftext|>`; with --chat-template, ChatML's `<|im_start|>`/`<|im_end|>`
and its template), what a model directory on the hub holds
(zero_jax/data/train_tokenizer.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zero_jax.data import train_tokenizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--vocab-size", type=int, default=8192, help="tokens, special ones included")
    p.add_argument("--sample-mb", type=float, default=4.0, help="MB of the corpus to train on")
    p.add_argument("--chat-template", action="store_true", help="add ChatML tokens and template")
    args = p.parse_args(argv)
    out = Path(args.out)
    tok = train_tokenizer.write(out, args.vocab_size, int(args.sample_mb * 1e6), args.chat_template)
    print(f"wrote {out}: byte-level BPE, {tok.get_vocab_size()} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
