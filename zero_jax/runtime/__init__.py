"""What a running job needs around its steps: several processes, watchdog,
preemption, profiles, metrics writers and simulated CPU devices."""
