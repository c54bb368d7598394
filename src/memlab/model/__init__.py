"""Models (``model=``): a tiny seeded model built from a config, or any Hugging Face model."""
