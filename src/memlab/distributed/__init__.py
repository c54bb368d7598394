"""Distributed setups (``distributed=``): ``single`` and ``ddp``; FSDP2 and DeepSpeed plug in
through the same shape (``memlab.distributed.base``) and launcher (``launch``)."""
