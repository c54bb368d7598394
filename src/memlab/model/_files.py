"""Where model and tokenizer files come from, checked before anything loads.

Not an option of its own (the registry skips modules whose name starts with ``_``).

* **Local directories** (a name that starts with ``/ . ~``, exists, or whose first path
  component exists): no such directory, no ``config.json``, no weight files, no tokenizer files
  each get an error naming the directory, what is missing and how to fix it.
* **Hub names**: with ``local_files_only`` or ``HF_HUB_OFFLINE=1`` the local Hugging Face cache
  is checked at once (no network call). Otherwise one metadata request with a short timeout and
  no retries (:data:`PROBE_TIMEOUT_S`) tells whether the hub answers: unreachable -> the cached
  copy is loaded offline if there is one, else an error within seconds (huggingface_hub's own
  retries take ~25 s per file, ~55 s for a tokenizer and its model); not found, gated or private
  -> an error saying so. The answer is remembered for the process.
* **An estimate** reads only a model's config.json (:func:`config_source`): a hub name that
  cannot be reached (offline, the hub down, a gated repo) and is not cached is estimated from
  memlab's shipped config of that model (``assets/model_configs/<name>``) where there is one,
  saying so; a run with weights still needs the hub or the cache.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from memlab.trainer.inputs import Inputs

PROBE_TIMEOUT_S = 5.0
"""Seconds to wait for the hub's answer to the one probe request (a lower
``HF_HUB_ETAG_TIMEOUT`` wins)."""

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "adapter_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tekken.json")

TOKENIZER_SIDE = (*TOKENIZER_FILES, "merges.txt", "tokenizer_config.json",
                  "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                  "chat_template.json")
"""Files of a saved model directory that belong to its tokenizer (and its chat template)."""


def is_tokenizer_file(path: Path) -> bool:
    """Whether ``path`` (a file of a saved model directory) is a tokenizer's."""
    return path.name in TOKENIZER_SIDE or path.name.startswith("tokenizer.model.") or (
        path.suffix == ".tiktoken")


def directory_inputs(name: str, revision: str | None) -> tuple[Inputs, Inputs]:
    """``(model, tokenizer)`` inputs of ``name``: a local directory's files (its tokenizer's
    files apart), or the hub repository for both."""
    if looks_like_path(name):
        root = [Path(os.path.expanduser(name))]
        return (Inputs.of_paths(root, lambda f: not is_tokenizer_file(f)),
                Inputs.of_paths(root, is_tokenizer_file))
    repo = Inputs(repo=f"models/{name}", revision=revision)
    return repo, repo


def template_inputs(path: str | None) -> Inputs:
    """A chat template file's input (a named template's: its shipped file; none without one)."""
    from memlab.data import templates

    named = templates.named(path)
    if named is not None:
        return Inputs.of_paths([str(named.path)])
    return Inputs.of_paths([path]) if path else Inputs()


_PROBED: dict[tuple[str, str | None, str], bool] = {}


class ModelFilesError(OSError):
    """Model or tokenizer files cannot be found; the message names where and the fix."""


class HubUnreachable(ModelFilesError):
    """A hub model's files cannot be fetched although the name may be right: offline or the hub
    unreachable (and not cached), or a gated repo without access. ``why``: that reason alone."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why


def looks_like_path(name: str) -> bool:
    """A local path rather than a hub id: starts with ``/ . ~``, exists, has more than one
    ``/``, or its first component is an existing directory."""
    if name.startswith(("/", ".", "~")) or os.path.exists(os.path.expanduser(name)):
        return True
    parts = Path(name).parts
    return len(parts) > 2 or (len(parts) > 1 and Path(parts[0]).is_dir())


def _nearest_parent(path: Path) -> str:
    for parent in path.parents:
        if parent.is_dir():
            return str(parent)
    return "/"


def path_errors(key: str, name: str, need: tuple[str, ...]) -> list[str]:
    """Problems of a local directory given as ``key=name``: it must exist and hold the files
    ``need`` names (``"config"``, ``"weights"``, ``"tokenizer"``)."""
    path = Path(os.path.expanduser(name)).absolute()
    if not path.exists():
        return [f"{key}={name}: no such directory ({path}; the nearest existing parent is "
                f"{_nearest_parent(path)}); give the directory of a saved model "
                "(save_pretrained) or a hub name such as Qwen/Qwen2.5-0.5B"]
    if not path.is_dir():
        return [f"{key}={name}: {path} is a file, not a directory; give the directory it is in"]
    files = {p.name for p in path.iterdir()}
    errors = []
    if "config" in need and "config.json" not in files:
        errors.append(f"{key}={name}: {path} has no config.json, so it is not a saved Hugging "
                      "Face model; save one there with model.save_pretrained(dir)")
    elif "config" in need:
        errors += _json_errors(key, name, path / "config.json")
    if "weights" in need and not _has_weights(files):
        errors.append(f"{key}={name}: {path} has no weight files ({', '.join(WEIGHT_FILES)}, or "
                      "shards *.safetensors); save the weights there with "
                      "model.save_pretrained(dir)")
    elif "weights" in need:
        errors += [f"{key}={name}: {problem}" for f in sorted(path.glob("*.safetensors"))
                   if (problem := _safetensors_problem(f))]
    if "tokenizer" in need and not _has_tokenizer(files):
        errors.append(f"{key}={name}: {path} has no tokenizer files "
                      f"({', '.join(TOKENIZER_FILES)}); save the tokenizer there with "
                      "tokenizer.save_pretrained(dir) or point model.tokenizer at one")
    return errors


def _json_errors(key: str, name: str, file: Path) -> list[str]:
    """A JSON file of a model directory that does not parse (truncated, half written)."""
    import json

    try:
        json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return [f"{key}={name}: {file} is not valid JSON ({e}); it is damaged (truncated?): "
                "save the model there again with model.save_pretrained(dir)"]
    return []


def _safetensors_problem(file: Path) -> str | None:
    """What is wrong with a weight file (its header, and whether it covers the whole file:
    a truncated file fails here; no tensor is read), or None."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt"):
            return None
    except Exception as e:  # noqa: BLE001 - damaged, whatever the library calls it
        return (f"{file} is not a readable safetensors file ({type(e).__name__}: {e}); it is "
                "damaged (truncated?): save the model there again with "
                "model.save_pretrained(dir)")


def _has_weights(files: set[str]) -> bool:
    return any(f in files for f in WEIGHT_FILES) or any(f.endswith(".safetensors")
                                                       for f in files)


def _has_tokenizer(files: set[str]) -> bool:
    return any(f in files for f in TOKENIZER_FILES) or any(
        f.startswith("tokenizer.model.") or f.endswith(".tiktoken") for f in files)


def check_local(key: str, name: str, need: tuple[str, ...]) -> None:
    """Raise :class:`ModelFilesError` with every problem of :func:`path_errors`."""
    errors = path_errors(key, name, need)
    if errors:
        raise ModelFilesError("; ".join(errors))


def chat_template_errors(key: str, path: str | None) -> list[str]:
    """``model.chat_template`` must name a shipped template
    (:data:`memlab.data.templates.NAMED`) or be a readable Jinja file that compiles."""
    from memlab.data import templates

    if path is None or templates.named(path):
        return []
    file = Path(os.path.expanduser(path))
    if not file.is_file():
        return [f"{key}={path}: no such file, and not a template memlab ships; name one "
                f"({', '.join(templates.NAMED)}) or give a Jinja chat template file (e.g. one "
                "with {% generation %} markers around each assistant answer)"]
    try:
        import jinja2

        text = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", file.read_text())  # HF's own tag
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        return [f"{key}={path}: not a valid Jinja template (line {e.lineno}: {e.message})"]
    except (OSError, UnicodeDecodeError) as e:
        return [f"{key}={path}: cannot be read ({e})"]
    return []


def apply_chat_template_file(tok, path: str | None):
    """Replace the tokenizer's chat template with the named template's text or the file's
    (``model.chat_template``); a named template whose markers the tokenizer lacks as special
    tokens is refused (:func:`memlab.data.templates.token_errors`)."""
    from memlab.data import templates

    named = templates.named(path)
    if named is not None:
        errors = templates.token_errors(tok, named)
        if errors:
            raise ModelFilesError("; ".join(errors))
        tok.chat_template = named.text()
    elif path is not None:
        tok.chat_template = Path(os.path.expanduser(path)).read_text()
    return tok


def offline(local_files_only: bool) -> bool:
    from huggingface_hub import constants

    return local_files_only or constants.is_offline_mode() or os.environ.get(
        "HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def hub_local_only(key: str, repo: str, revision: str | None, local_files_only: bool,
                   filename: str = "config.json") -> bool:
    """Whether ``repo`` (a hub name) must be loaded from the local cache only (``filename``: a
    file every such repo has, config.json for a model). Raises
    :class:`ModelFilesError` at once when it cannot be loaded at all: offline and not cached,
    or the hub unreachable (probed once, :data:`PROBE_TIMEOUT_S`) and not cached, or the hub
    answering that the repo does not exist / is gated."""
    cached = _cached(repo, revision, filename)
    if offline(local_files_only):
        if not cached:
            why = ("model.local_files_only=true" if local_files_only else "HF_HUB_OFFLINE=1")
            raise HubUnreachable(
                f"{key}={repo}: not in the local Hugging Face cache ({_cache_dir()}), and {why} "
                "forbids downloading it; download it where the hub can be reached "
                f"(`hf download {repo}`) and pass that directory, or unset {why}",
                f"not in the local Hugging Face cache, and {why} forbids downloading it")
        return True
    reachable = _probe(key, repo, revision, filename)
    if not reachable and not cached:
        raise HubUnreachable(
            f"{key}={repo}: the Hugging Face hub ({_endpoint()}) cannot be reached and the model "
            f"is not in the local cache ({_cache_dir()}); download it where the hub can be "
            f"reached (`hf download {repo} --local-dir DIR`) and set {key}=DIR, or check the "
            "network / HF_ENDPOINT",
            f"the Hugging Face hub ({_endpoint()}) cannot be reached and the model is not cached")
    return not reachable


def shipped_config(repo: str) -> Path | None:
    """memlab's shipped config directory of hub model ``repo`` (``assets/model_configs/<name>``,
    ``<name>`` the part after the owner, matched regardless of case), or None."""
    from memlab.resolvers import ASSETS

    name = repo.rsplit("/", 1)[-1].lower()
    return next((d for d in sorted((ASSETS / "model_configs").iterdir())
                 if d.name.lower() == name and (d / "config.json").is_file()), None)


def shipped_configs() -> list[str]:
    """The names of the models whose config memlab ships."""
    from memlab.resolvers import ASSETS

    return sorted(d.name for d in (ASSETS / "model_configs").iterdir()
                  if (d / "config.json").is_file())


def config_source(key: str, repo: str, revision: str | None, local_files_only: bool
                  ) -> tuple[str, str | None]:
    """Where an estimate, which reads no weights, takes hub model ``repo``'s config.json from:
    ``(repo, None)`` when the hub or the local cache has it (:func:`hub_local_only`); when it
    cannot be reached nor is cached (:class:`HubUnreachable`), memlab's shipped config of that
    model and one line saying so. Raises :class:`ModelFilesError` (one line naming the fix)
    when there is none, or when the hub answers that there is no such model."""
    try:
        hub_local_only(key, repo, revision, local_files_only)
        return repo, None
    except HubUnreachable as e:
        shipped = shipped_config(repo)
        if shipped is None:
            raise ModelFilesError(
                f"{e}; an estimate needs only the model's config.json: give a directory holding "
                f"it ({key}=DIR), or estimate one of the architectures memlab ships "
                f"({key}=${{memlab.asset:model_configs/NAME}}, NAME one of "
                f"{', '.join(shipped_configs())})") from None
        return str(shipped), (
            f"{key}={repo}: {e.why}; estimating memlab's shipped config of {shipped.name} "
            f"({shipped / 'config.json'}): the same architecture, no weights needed")


def _probe(key: str, repo: str, revision: str | None, filename: str) -> bool:
    """One HEAD request for ``filename`` without retries; True when the hub answered that the
    file exists. Raises for a repo the hub says is missing, gated or private."""
    if (repo, revision, filename) in _PROBED:
        return _PROBED[(repo, revision, filename)]
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    timeout = min(PROBE_TIMEOUT_S, float(constants.HF_HUB_ETAG_TIMEOUT))
    url = hf_hub_url(repo, filename, revision=revision)
    try:
        get_hf_file_metadata(url, timeout=timeout)
        ok = True
    except GatedRepoError as e:
        raise HubUnreachable(f"{key}={repo}: a gated model; accept its license on the hub and "
                             f"log in (`hf auth login` or HF_TOKEN) ({e})",
                             "a gated model, and this login has no access") from e
    except RepositoryNotFoundError as e:
        raise ModelFilesError(f"{key}={repo}: no such model on the hub (or it is private: log "
                              "in with `hf auth login` or HF_TOKEN); check the name, or give a "
                              "local directory") from e
    except RevisionNotFoundError as e:
        raise ModelFilesError(f"{key}={repo}: the hub has no revision {revision!r}; check "
                              "model.revision") from e
    except EntryNotFoundError as e:
        raise ModelFilesError(f"{key}={repo}: the hub repo has no {filename}, so it is not a "
                              "transformers model / tokenizer") from e
    except HfHubHTTPError:
        ok = False  # a server error: treat as unreachable (cached copy, or the error below)
    except Exception:  # noqa: BLE001 - connection refused, DNS failure, timeout, proxy errors
        ok = False
    _PROBED[(repo, revision, filename)] = ok
    return ok


def _cached(repo: str, revision: str | None, filename: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo, filename, revision=revision), str)
    except Exception:  # noqa: BLE001 - an invalid repo id is simply not cached
        return False


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def shape_mismatches(key: str, name: str, model_class: Any, config: Any) -> str:
    """Why a model directory's weights do not load into the model its config.json describes:
    each weight whose shape in the files differs from the config's (from the safetensors
    headers and the model built on the meta device: nothing is read or allocated)."""
    import json
    import struct

    import torch

    path = Path(os.path.expanduser(name))
    stored: dict[str, list[int]] = {}
    for f in sorted(path.glob("*.safetensors")) if path.is_dir() else []:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        stored.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    with torch.device("meta"):
        expected = {k: list(t.shape) for k, t in model_class.from_config(config).state_dict().items()}
    bad = [f"{k}: {stored[k]} in the weights, {expected[k]} from config.json"
           for k in sorted(set(stored) & set(expected)) if stored[k] != expected[k]]
    what = "; ".join(bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4 else "")
    return (f"{key}={name}: config.json does not describe the weights saved beside it"
            + (f" ({len(bad)} tensor(s): {what})" if bad else "")
            + "; save the config and the weights of one model together (save_pretrained), or "
              "fix config.json")
