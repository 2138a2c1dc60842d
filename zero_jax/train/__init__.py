"""One optimizer step: the train state (state.py), the pure train and eval
steps (step.py), the gradients over microbatches (accumulate.py) and the
optimizer (optim.py)."""
