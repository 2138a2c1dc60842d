"""Training data: corpora and their checks, deterministic batches, the read
order, the prepared on-disk format, tokenizers and corpus preparation."""
