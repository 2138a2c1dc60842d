"""Pipeline parallelism over the `pipe` mesh axis: schedule tables, the cut
of the layer stack into stages, and the `shard_map` executor that runs them."""
