"""Parameter-efficient fine-tuning (``peft=``): none, LoRA, QLoRA (4/8-bit base)."""
