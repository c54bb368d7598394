"""memlab's Hydra app: the only ``@hydra.main`` (``memlab`` / ``python -m memlab`` train and
sweep through :func:`main`; ``memlab estimate`` and ``memlab lengths`` run their own task over the
same configs and command line through :func:`run_app`).

memlab's configs are the repo's top-level ``conf/`` (``config.yaml`` and the config groups), and
its ready sweeps the top-level ``sweeps/``; a wheel ships both inside the package (``memlab/conf``,
``memlab/sweeps``), an editable install reads the checkout's (:func:`memlab.cli.compose.conf_dir`),
so an installed memlab runs from any directory exactly as a checkout does. Hydra gets ``conf/`` as
an absolute config dir, and ``hydra_plugins/memlab_sweeps`` mounts ``sweeps/`` as the ``sweep``
group right after it (``memlab -m sweep=<name>``). ``--config-dir DIR`` (or
``hydra.searchpath=[file://DIR]``) adds a user's own configs on top (``DIR/sweep/mine.yaml`` is
``sweep=mine``); ``--info searchpath`` lists where each comes from.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import hydra

from memlab.cli.compose import conf_dir
from memlab.hydra_task import hydra_task

CONFIG_PATH = str(conf_dir())
"""Where Hydra finds memlab's primary config (``config.yaml``) and its groups (an absolute dir:
``hydra.main`` takes a directory or a ``pkg://`` module, and an editable install has no module
holding ``conf/``)."""
CONFIG_NAME = "config"


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg) -> dict:
    """Train (or sweep with -m) as configured; writes summary.json per job."""
    return hydra_task(cfg)


def run_app(task: Callable[[Any], Any], argv: Sequence[str], prog: str = "memlab") -> None:
    """Run ``task(cfg)`` as a Hydra app over memlab's configs with the command line ``argv``:
    the same overrides, flags (``-m``, ``--cfg``, ``-sc``...), output dirs and sweeper as a
    training run. Used by ``memlab estimate`` and ``memlab lengths`` (in-process, so that a test
    may call them repeatedly: Hydra's global state is cleared before and after). An unknown
    group option or key on ``argv`` is an error (exit 2) before Hydra starts
    (:func:`memlab.cli.overrides.command_line_error`)."""
    from hydra.core.global_hydra import GlobalHydra

    from memlab.cli.overrides import command_line_error

    err = command_line_error(argv)
    if err:  # an unknown option or key: nothing runs (Hydra would run a default or advise +)
        print(f"{prog}: {err}", file=sys.stderr)
        raise SystemExit(2)
    saved = sys.argv
    GlobalHydra.instance().clear()
    sys.argv = [prog, *argv]
    try:
        hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)(task)()
    finally:
        sys.argv = saved
        GlobalHydra.instance().clear()
