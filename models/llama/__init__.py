"""The Llama family (Llama 2 and 3, Mistral, Qwen2, and the mixtures of
experts Mixtral, Qwen2-MoE and Qwen3-MoE): the model and activation count
(model.py), its presets (presets.py), the mixture-of-experts MLP its
mixtures use in place of the dense one (moe.py), and its mapping to
Hugging Face's layouts (hf.py). All are loaded with the family, so that
`from models import llama` reaches `llama.model`, `llama.hf` and the rest."""

from models.llama import hf, model, moe, presets

__all__ = ["hf", "model", "moe", "presets"]
