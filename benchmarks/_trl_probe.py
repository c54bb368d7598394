"""What the TRL sides of the benchmarks (techniques.py, online.py, real_size_trl.py) share:
memlab's :class:`memlab.measure.memory.MemoryProbe` hooked into a TRL trainer's step.

Imported by those scripts from their own directory (a script's directory is on ``sys.path``).
"""

from __future__ import annotations

from typing import Any


def watch_trainer(probe: Any, trainer: Any, model: Any) -> None:
    """The probe watches ``model`` and the trainer's optimizer (once), and the trainer's
    ``accelerator.backward`` runs as the probe's ``backward`` phase, each call ending a
    micro-batch (wrapped once per accelerator). Call it inside ``training_step``, where the
    optimizer exists."""
    if not probe._external:
        probe.watch(model, getattr(trainer.optimizer, "optimizer", trainer.optimizer))
    accelerator = trainer.accelerator
    if getattr(accelerator, "_bench_wrapped", False):
        return
    orig = accelerator.backward

    def backward(loss, **kw):
        with probe.phase("backward"):
            orig(loss, **kw)
        probe.micro_end()

    accelerator.backward = backward
    accelerator._bench_wrapped = True
