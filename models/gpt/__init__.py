"""The GPT: the model, its presets and activation count (model.py), and its
mapping to Hugging Face's GPT-2 layout (hf.py). Both are loaded with the
family, so that `from models import gpt` reaches `gpt.model` and `gpt.hf`."""

from models.gpt import hf, model

__all__ = ["hf", "model"]
