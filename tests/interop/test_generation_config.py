"""The special tokens' ids a Hugging Face export writes, as transformers
reads them: a model fine-tuned from a Hugging Face directory on data
prepared with its own tokenizer keeps that model's bos, eos and pad, in
`model.config` and in `model.generation_config` (generation_config.json),
whether the data was prepared with the directory or with a copy of its
tokenizer.json elsewhere.

Run by `make test-interop`.
"""

import pytest

transformers = pytest.importorskip("transformers", reason="make test-interop installs transformers")

from tests.test_export_tokenizer import export, fine_tuned  # noqa: E402, F401


@pytest.mark.parametrize("data", ["own", "copy"])
def test_from_pretrained_begins_and_stops_as_the_model_did(
        fine_tuned, data, tmp_path):  # noqa: F811 - the fixture, imported
    _, checkpoints = fine_tuned
    assert export(checkpoints[data], tmp_path / "hf") == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "MixtralForCausalLM"
    assert (model.config.bos_token_id, model.config.eos_token_id) == (1, 0)
    g = model.generation_config
    assert (g.bos_token_id, g.eos_token_id, g.pad_token_id, g.max_new_tokens) == (1, [0, 2], 2, 64)
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "hf").to_diff_dict() == \
        g.to_diff_dict()
