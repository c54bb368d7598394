"""The ready sweeps (the repo's top-level ``sweeps/``) as the config group ``sweep`` of memlab.

Hydra names a config group after its directory, and memlab's configs (``conf/``) have no
``sweep/``: the sweeps are a top-level directory of their own. Two small Hydra plugins (found,
like memlab's launcher, in the ``hydra_plugins`` namespace package) mount it:

- :class:`MountedGroupSource`, the config source of the scheme ``memlab``: ``memlab://GROUP=DIR``
  serves the yaml files of ``DIR`` as the options of the group ``GROUP`` (``sweep/foundation``
  is ``DIR/foundation.yaml``).
- :class:`MemlabSweeps`: in every search path that holds memlab's configs
  (:func:`memlab.cli.compose.conf_dir`: the primary config dir of ``memlab``, ``memlab estimate``,
  ``memlab lengths`` and of :func:`memlab.cli.compose.compose`) it adds
  ``memlab://sweep=<sweeps dir>`` right after that entry, so ``memlab -m sweep=<name>`` runs a
  ready sweep. A user's own configs add to both (``--config-dir DIR``, which Hydra places after
  them: ``DIR/sweep/mine.yaml`` is ``sweep=mine``); other Hydra apps are left alone.

Both directories come from :mod:`memlab.cli.compose` (inside the package in a wheel, the
checkout's in an editable install). Hydra imports this module at every start-up: it stays light.
"""

from __future__ import annotations

import os
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath, SearchPathQuery
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf

SCHEME = "memlab"


class MountedGroupSource(ConfigSource):
    """``memlab://GROUP=DIR``: the config group ``GROUP`` whose options are ``DIR/*.yaml``."""

    def __init__(self, provider: str, path: str) -> None:
        super().__init__(provider=provider, path=path)
        self.group, eq, directory = self.path.partition("=")
        if not eq or not self.group or "/" in self.group or not directory:
            raise ValueError(f"{SCHEME}://{self.path}: expected {SCHEME}://GROUP=DIR")
        self.dir = Path(directory)

    @staticmethod
    def scheme() -> str:
        return SCHEME

    def _file(self, config_path: str) -> Path | None:
        """The file of ``GROUP/name`` (None for any other path)."""
        group, _, name = config_path.strip("/").partition("/")
        if group != self.group or not name or "/" in name:
            return None
        return self.dir / self._normalize_file_name(name)

    def available(self) -> bool:
        return self.dir.is_dir()

    def is_group(self, config_path: str) -> bool:
        return config_path.strip("/") in ("", self.group) and self.available()

    def is_config(self, config_path: str) -> bool:
        path = self._file(config_path)
        return path is not None and path.is_file()

    def load_config(self, config_path: str) -> ConfigResult:
        path = self._file(config_path)
        if path is None or not path.is_file():
            raise ConfigLoadError(f"Config not found : {config_path} ({self.full_path()})")
        text = path.read_text(encoding="utf-8")
        return ConfigResult(config=OmegaConf.create(text) if text.strip() else OmegaConf.create(),
                            path=self.full_path(), provider=self.provider,
                            header=ConfigSource._get_header_dict(text[:512]))

    def list(self, config_path: str, results_filter: ObjectType | None) -> list[str]:
        where = config_path.strip("/")
        if where == "" and self.available() and results_filter in (None, ObjectType.GROUP):
            return [self.group]
        if where == self.group and self.available() and results_filter in (
                None, ObjectType.CONFIG):
            return sorted(p.stem for p in self.dir.glob("*.yaml") if p.is_file())
        return []


def _same_dir(search_path: str, directory: Path) -> bool:
    """Whether a search path entry (a plain path or ``file://``) is ``directory``."""
    if search_path.startswith("file://"):
        search_path = search_path[len("file://"):]
    elif "://" in search_path:
        return False
    return os.path.realpath(search_path) == os.path.realpath(directory)


class MemlabSweeps(SearchPathPlugin):
    """Mounts memlab's ready sweeps as the group ``sweep`` after memlab's configs."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        try:
            from memlab.cli.compose import conf_dir, sweeps_dir

            conf, sweeps = conf_dir(), sweeps_dir()
        except (ImportError, FileNotFoundError):
            return  # no usable memlab here (memlab's own app says why when it starts)
        for element in list(search_path.get_path()):
            if _same_dir(element.path, conf):
                search_path.append("memlab", f"{SCHEME}://sweep={sweeps}",
                                   anchor=SearchPathQuery(element.provider, element.path))
                return
