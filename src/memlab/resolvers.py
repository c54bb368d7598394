"""The one OmegaConf resolver memlab's configs (``conf/``) use, registered on import (by
:mod:`memlab.config`): ``${memlab.asset:PATH}`` is the absolute path of ``PATH`` under the
package's ``assets/`` (e.g. ``${memlab.asset:model_configs/Qwen2.5-0.5B}``, the architecture a
shipped experiment estimates with), so a config names a shipped file wherever memlab is
installed."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"


def asset(path: str) -> str:
    """Absolute path of ``path`` under memlab's ``assets/`` (it must exist)."""
    full = (ASSETS / path).resolve()
    if ASSETS not in full.parents and full != ASSETS:
        raise ValueError(f"${{memlab.asset:{path}}}: outside memlab's assets")
    if not full.exists():
        shipped = sorted(p.relative_to(ASSETS).as_posix() for p in ASSETS.glob("*/*"))
        raise FileNotFoundError(f"${{memlab.asset:{path}}}: memlab ships no {path}; shipped: "
                                f"{', '.join(shipped)}")
    return str(full)


def _register() -> None:
    try:
        from omegaconf import OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return
    if not OmegaConf.has_resolver("memlab.asset"):
        OmegaConf.register_new_resolver("memlab.asset", asset)


_register()
