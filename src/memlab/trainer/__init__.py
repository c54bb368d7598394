"""The training loop."""

from memlab.trainer.loop import TrainResult, Trainer

__all__ = ["Trainer", "TrainResult"]
