"""The Llama family (Llama 2 and 3, Mistral, Qwen2, and the mixtures of
experts Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and Kimi-K2): its shape
and counts (config.py), the model (model.py), its presets (presets.py),
the mixture-of-experts MLP its mixtures use in place of the dense one
(moe.py), DeepSeek's latent attention (mla.py), and its mapping to Hugging
Face's layouts (hf.py, deepseek_hf.py) and of LoRA adapters to peft's (peft.py). All are loaded with the family, so
that `from models import llama` reaches `llama.model`, `llama.hf` and the rest."""

from models.llama import config, deepseek_hf, hf, mla, model, moe, peft, presets

__all__ = ["config", "deepseek_hf", "hf", "mla", "model", "moe", "peft", "presets"]
