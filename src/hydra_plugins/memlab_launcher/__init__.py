"""memlab's isolating Hydra launcher (``hydra/launcher=memlab``)."""
