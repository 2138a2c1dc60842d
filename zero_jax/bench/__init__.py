"""Benchmarks: fixed suites of training runs, each compiled, run and timed
on the devices at hand.

A folder of its own because a benchmark is neither of its neighbours:
analysis/ reads a program without running it and planner/ estimates a
cluster it does not have, while a benchmark runs real steps here and
measures them. suites.py holds the cases as data; measure.py compiles,
runs and times one case, and a suite of them.
"""
