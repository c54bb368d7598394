"""Compose conf/ outside a Hydra app (``memlab estimate``, ``memlab lengths``): the same config a
run with the same overrides gets."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def conf_dir() -> Path:
    """The repository's ``conf/`` (the one ``python -m memlab`` composes)."""
    import memlab

    return Path(memlab.__file__).resolve().parents[2] / "conf"


def compose(overrides: Sequence[str]):
    """(config without the hydra node, group choices) composed over :func:`conf_dir`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides),
                            return_hydra_config=True)
    choices = {str(k): str(v) for k, v in cfg.hydra.runtime.choices.items()
               if not str(k).startswith("hydra/") and v is not None}
    with open_dict(cfg):
        del cfg["hydra"]
    return OmegaConf.create(OmegaConf.to_container(cfg)), choices
