"""``python -m memlab ...``: the same command line as the ``memlab`` console script
(:mod:`memlab.cli.main`); the Hydra app itself is :mod:`memlab.cli.app`."""

from __future__ import annotations

import sys

from memlab.cli.main import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m memlab"))
