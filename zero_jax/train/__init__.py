"""One optimizer step: the train state (state.py), the pure train and eval
steps (step.py) and their options (options.py), the loss and gradients by
the layout's strategy (grads.py), the gradients over microbatches
(accumulate.py) and the optimizer (optim.py)."""
