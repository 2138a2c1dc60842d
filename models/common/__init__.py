"""What both model families share: norms, activations, rotary embeddings,
attention and parameter declaration (layers.py), the pre-norm transformer
block each family fills with its own pieces (block.py), the scanned layer
stack and the functions the train step needs (decoder.py), and a Hugging
Face directory's files in and out (hf_files.py)."""
