"""What the benchmarks' ``--dry-run`` share: every case's memlab configuration composed through
Hydra and validated as a run would (:func:`memlab.cli.compose.compose` +
:func:`memlab.context.validate`: nothing built, no model, no data), one line printed per case,
and the count of invalid ones (a renamed option makes the dry run, and the test that runs it,
fail, naming the case and the problem).

Imported by the scripts from their own directory (a script's directory is on ``sys.path``).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable, Sequence
from typing import Any

TRL_MISSING = "trl not installed: its cases not built"


def check(who: str, cases: Iterable[tuple[str, Sequence[str]]], platform: Any = None,
          validator: Callable[[Any, dict[str, str]], Any] | None = None) -> int:
    """Compose and validate each ``(name, overrides)`` (``validator(cfg, choices)``, else
    :func:`memlab.context.validate` on ``platform``, None: this machine); print its verdict;
    the number invalid."""
    from memlab.cli.compose import compose
    from memlab.context import validate
    from memlab.registry import ConfigErrors

    bad = 0
    for name, overrides in cases:
        try:
            cfg, choices = compose(list(overrides))
            if validator is not None:
                validator(cfg, choices)
            else:
                validate(cfg, ".", choices, platform=platform)
            status = "valid"
        except ConfigErrors as e:
            status, bad = f"INVALID: {e}", bad + 1
        print(f"  [{who}] {name:44} {status}")
    return bad


def for_estimate(device: str) -> Callable[[Any, dict[str, str]], Any]:
    """The validation ``memlab estimate`` makes for ``device``
    (:func:`memlab.context.validate_for`)."""
    from memlab.context import validate_for

    return lambda cfg, choices: validate_for(cfg, device, choices)


def show(who: str, name: str, argv: Sequence[str]) -> None:
    """A command line the benchmark would run."""
    print(f"  [{who}] {name:44} $ {shlex.join(str(a) for a in argv)}")


def trl_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def done(who: str, bad: int, problems: Sequence[str] = ()) -> int:
    """Print the outcome (``problems``: what else did not check out); 0 when all is valid."""
    for p in problems:
        print(f"  [{who}] INVALID: {p}")
    bad += len(problems)
    print(f"[{who}] dry run: {bad} invalid")
    return 1 if bad else 0
