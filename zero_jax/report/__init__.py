"""What is printed of a prepared `Job`: the plan before training, what runs
where and its bytes (summary.py), the pipeline part (pipeline_summary.py);
and where a train step spends its time (anatomy.py)."""
