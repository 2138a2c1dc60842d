"""What a model is to zero_jax: the contract it implements (contract.py),
the hooks it calls to place, cast and name its tensors (hooks.py), how it
uses its parameters (param_use.py), what its backward pass keeps (remat.py)
and its loss (loss.py)."""
