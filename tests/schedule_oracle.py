"""A schedule's table checked against what the loop needs of it: the tests'
oracle for every schedule zero_jax/pipeline/schedule.py builds (each action
once, in dependency order, within a tick's limits)."""

from __future__ import annotations

from zero_jax.pipeline.schedule import W_PER_TICK, Schedule


def violations(s: Schedule) -> list[str]:
    """Everything wrong with a table (empty for a valid one); the tests' oracle.
    Within a tick a device's actions run in their order; a message from
    another device is usable the tick after it is sent."""
    problems, when = [], {}
    for t, row in enumerate(s.table):
        for d, acts in enumerate(row):
            kinds = [a.kind for a in acts]
            if kinds.count("F") > 1 or kinds.count("B") > 1 or kinds.count("W") > W_PER_TICK:
                problems.append(f"tick {t} device {d}: {kinds} is more than a tick runs")
            for i, a in enumerate(acts):
                key = (a.kind, a.mb, s.global_chunk(d, a))
                if key in when:
                    problems.append(f"{key} runs twice")
                when[key] = (t, i)
    last = s.chunks - 1
    for mb in range(s.m):
        for g in range(s.chunks):
            f, b = when.get(("F", mb, g)), when.get(("B", mb, g))
            w = when.get(("W", mb, g))
            if f is None or b is None or (s.split_backward and w is None):
                problems.append(f"microbatch {mb} chunk {g}: an action is missing")
                continue
            if not f < b:
                problems.append(f"microbatch {mb} chunk {g}: backward at {b} before forward at {f}")
            if w is not None and not b < w:
                problems.append(f"microbatch {mb} chunk {g}: weight gradient before backward")
            if g > 0 and not when.get(("F", mb, g - 1), f)[0] < f[0]:
                problems.append(f"microbatch {mb} chunk {g}: forward before its input")
            if g < last and not when.get(("B", mb, g + 1), b)[0] < b[0]:
                problems.append(f"microbatch {mb} chunk {g}: backward before its gradient")
    return problems
