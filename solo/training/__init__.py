"""Training-side utilities (tokenizer training for small test and draft models)."""
