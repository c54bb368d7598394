"""Generation engines of the online methods (``generation=<name>``): transformers' ``generate``
(``hf``) or vLLM (``vllm``, in the training process or behind a server)."""
