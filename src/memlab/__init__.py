"""memlab: measure and reduce the memory and time of LLM fine-tuning."""

__version__ = "0.1.0"
