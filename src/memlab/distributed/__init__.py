"""Distributed setups (``distributed=``). Only ``single`` exists yet; ``ddp``, ``fsdp2`` and
``deepspeed_zero3`` plug in here through the same ``setup`` / ``wrap`` shape."""
