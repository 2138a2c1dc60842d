"""Numbers: the dtype of each state and computation (policies.py), float32
master weights (master.py), dynamic loss scaling (loss_scale.py), and the
roundings remat adds taken out of the traced step (rounding.py)."""
