"""What a run costs, read without running it: bytes per device, collective
traffic in the compiled HLO, FLOPs and MFU, and the plan printed before
training."""
