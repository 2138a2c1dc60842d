"""The plan printed before training, read from a prepared `Job`: what runs
where and its bytes (summary.py), the pipeline part (pipeline_summary.py)."""
