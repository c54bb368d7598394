"""Attention backends (``attention=``): Hugging Face ``attn_implementation`` values."""
