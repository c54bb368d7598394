"""``python -m memlab [overrides]``: the Hydra app (the only place that touches @hydra.main).

``mode=`` picks what the same overrides are for, before Hydra sees them:
``mode=train`` (the default: train, or sweep with ``-m``), ``mode=estimate`` (``memlab
estimate``: predicted peak memory on fake tensors; its options such as ``--budget 24GiB`` may
follow) and ``mode=lengths`` (``memlab lengths``).
"""

from __future__ import annotations

import sys

import hydra

from memlab.run import hydra_task

MODES = {"train": None, "estimate": "memlab.cli.estimate", "lengths": "memlab.cli.lengths"}


@hydra.main(version_base="1.3", config_path="../../conf", config_name="config")
def main(cfg) -> dict:
    """Train (or sweep with -m) as configured; writes summary.json per job."""
    return hydra_task(cfg)


def dispatch(argv: list[str]) -> tuple[str | None, list[str]]:
    """``(module of the mode's command or None for training, argv without mode=...)``; raises
    ValueError for an unknown mode."""
    modes = [a.split("=", 1)[1] for a in argv if a.startswith("mode=")]
    rest = [a for a in argv if not a.startswith("mode=")]
    mode = modes[-1] if modes else "train"
    if mode not in MODES:
        raise ValueError(f"mode={mode} is not a mode; use one of: "
                         + ", ".join(f"mode={m}" for m in MODES))
    return MODES[mode], rest


if __name__ == "__main__":
    try:
        module, args = dispatch(sys.argv[1:])
    except ValueError as e:
        print(f"memlab: {e}", file=sys.stderr)
        sys.exit(2)
    if module is None:
        sys.argv = [sys.argv[0], *args]
        main()
    else:
        import importlib

        sys.exit(importlib.import_module(module).main(args))
