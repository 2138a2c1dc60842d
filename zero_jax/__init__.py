"""zero_jax: ZeRO-sharded training of models too large for one accelerator, on JAX/XLA.

At the top stand the three modules a reader follows: job.py (a run config
and a model -> everything a run needs, built abstractly), loop.py (the host
loop) and run.py (a run end to end). Each subpackage holds one concept, in
layers (docs/architecture.md, kept by tests/test_imports.py), bottom up:
config/ (the run config, no JAX), runtime/ (processes, devices, metrics),
sharding/ (meshes, axis rules, the ZeRO table, offload), data/ and context/,
model/ (what a model implements and calls), precision/, pipeline/, train/
(the state and the step), checkpoint/, analysis/ (bytes, traffic, FLOPs),
then above job.py: planner/, report/ (the printed plan), bench/ and cli/
(the `zero-jax` command).
"""
