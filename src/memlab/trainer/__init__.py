"""The training loop."""

from memlab.trainer.loop import Trainer, TrainResult

__all__ = ["Trainer", "TrainResult"]
