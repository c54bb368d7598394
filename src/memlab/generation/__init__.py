"""How online methods sample completions (``generation=``): transformers' ``generate`` on the
training policy (``hf``) or a vLLM engine (``vllm``)."""
