"""The Hugging Face export of a run on a BPE tokenizer's data carries that
tokenizer: `AutoTokenizer.from_pretrained(export)` gives the ids the data
was prepared with.

Run by `make test-interop`, which installs transformers and a CPU build of
torch in a separate environment; `make test` leaves this directory out.
"""

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="make test-interop installs transformers")

from tests.helpers import make_job, train  # noqa: E402
from tests.test_export_tokenizer import make_tokenizer, prepared  # noqa: E402
from zero_jax import run  # noqa: E402
from zero_jax.checkpoint import manager as manager_lib  # noqa: E402
from zero_jax.cli import export as export_cli  # noqa: E402
from zero_jax.data import corpus as corpus_lib  # noqa: E402
from zero_jax.data import tokenizers as tokenizers_lib  # noqa: E402

SAMPLE = "def f(x):\n    return x + 12345  # héllo, wörld 🙂\n\n\tend<|endoftext|>"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(tokenizer directory, data directory, checkpoint) of two steps of gpt-tiny on BPE data."""
    tmp = tmp_path_factory.mktemp("bpe")
    tok = make_tokenizer(tmp / "tok")
    data = prepared(tmp, str(tok))
    corpus = corpus_lib.load(str(data))
    job = make_job(corpus, data=str(data), steps=2, batch_size=8)
    _, state = train(job, corpus)
    c = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(tmp / "ckpt")), job.state_plan.names,
                              writer=True)
    c.save(2, state, run.checkpoint_meta(job, 2, corpus))
    c.wait()
    return tok, data, tmp / "ckpt"


def ours(tokenizer: str, text: str, special: bool = False) -> list[int]:
    return tokenizers_lib.Encoder(tokenizers_lib.resolve(tokenizer)).ids(text, special)


def test_auto_tokenizer_of_the_export_gives_our_ids(trained, tmp_path):
    tok, data, ckpt = trained
    assert export_cli.main(["--checkpoint-dir", str(ckpt), "--hf-dir", str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs(SAMPLE, add_special_tokens=False)["input_ids"] == ours(str(tok), SAMPLE)
    assert theirs(SAMPLE)["input_ids"] == ours(str(tok), SAMPLE, special=True)
    assert theirs.decode(ours(str(tok), SAMPLE)) == SAMPLE
    meta = json.loads((data / "meta.json").read_text())
    assert theirs.eos_token_id == meta["eos_id"]
    # The first training document, tokenized by transformers, is what the run read.
    shard = corpus_lib.load(str(data)).train[0]
    end = shard.docs[1] if len(shard.docs) > 1 else len(shard.tokens)
    first = np.asarray(shard.tokens[:end]).tolist()
    text = theirs.decode(first[:-1])
    assert theirs(text)["input_ids"] + [theirs.eos_token_id] == first
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert len(theirs) <= model.config.vocab_size
    # generate stops where the run's documents end, not on GPT-2's default 50256
    assert model.config.eos_token_id == model.generation_config.eos_token_id == meta["eos_id"]


def test_a_tokenizer_splitting_otherwise_than_gpt2_still_gives_its_own_ids(trained, tmp_path):
    """GPT2Tokenizer, which AutoTokenizer would pick for a GPT-2 config.json,
    rebuilds GPT-2's pre-tokenizer (no prefix space): the export's
    tokenizer_config.json names PreTrainedTokenizerFast, which reads
    tokenizer.json as it is."""
    from tokenizers import Tokenizer, pre_tokenizers

    tok, _, ckpt = trained
    spaced = Tokenizer.from_file(str(tok / "tokenizer.json"))
    spaced.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    (tmp_path / "spaced").mkdir()
    spaced.save(str(tmp_path / "spaced" / "tokenizer.json"))
    assert export_cli.main(["--checkpoint-dir", str(ckpt), "--hf-dir", str(tmp_path / "hf"),
                            "--tokenizer", str(tmp_path / "spaced")]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    want = ours(str(tmp_path / "spaced"), SAMPLE)
    assert want != ours(str(tok), SAMPLE)  # the two tokenizers do split the sample otherwise
    assert theirs(SAMPLE, add_special_tokens=False)["input_ids"] == want
