"""The training loop (:mod:`memlab.trainer.loop`), its batches, optimizer, checkpoints and
the routing of calls through distributed wrappers. The lowest layer with the losses and the
measurements: it imports no technique package."""
