"""The optimizer (``optimizer=``): adamw, adamw_8bit, paged_adamw_8bit, adafactor, sgd; and
``optimizer.in_backward`` (each parameter stepped inside backward)."""
