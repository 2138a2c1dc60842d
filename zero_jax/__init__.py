"""zero_jax: ZeRO-sharded training of models too large for one accelerator, on JAX/XLA.

The core at the top follows one step: config -> job -> state -> step -> loop
(docs/architecture.md). The subpackages hold one concept each: sharding/
(meshes, axis rules, the ZeRO table), pipeline/, checkpoint/, data/,
analysis/ (bytes, traffic, FLOPs, the printed plan), planner/, runtime/
(processes, watchdog, metrics, simulated devices), bench/ and cli/ (the
`zero-jax` command).
"""
