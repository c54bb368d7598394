"""``python -m memlab [overrides]``: the Hydra app (the only place that touches @hydra.main)."""

from __future__ import annotations

import hydra

from memlab.run import hydra_task


@hydra.main(version_base="1.3", config_path="../../conf", config_name="config")
def main(cfg) -> dict:
    """Train (or sweep with -m) as configured; writes summary.json per job."""
    return hydra_task(cfg)


if __name__ == "__main__":
    main()
