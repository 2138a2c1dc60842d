"""Pipeline parallelism over the `pipe` mesh axis: schedule tables, the cut
of the layer stack into stages, the schedule compiled into the index tables
a loop reads, and the `shard_map` executor that runs that loop."""
