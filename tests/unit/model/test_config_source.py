"""Where an estimate reads a hub model's config.json (:func:`memlab.model._files.config_source`):
the hub or the cache when they have it; memlab's shipped config of the same model when the hub
cannot be reached (offline, down, gated) and it is not cached; else one line naming the fix.
A run with weights is not changed: its loading still needs the hub or the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from memlab.model import _files
from memlab.model._files import HubUnreachable, ModelFilesError, config_source
from memlab.resolvers import ASSETS

KEY = "model.name_or_path"
SHIPPED_7B = ASSETS / "model_configs" / "Qwen2.5-7B-Instruct"


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(_files, "_cached", lambda repo, revision, filename: False)


def test_offline_and_not_cached_a_shipped_model_reads_its_shipped_config(offline):
    where, note = config_source(KEY, "Qwen/Qwen2.5-7B-Instruct", None, False)
    assert Path(where) == SHIPPED_7B
    assert note is not None and "\n" not in note
    assert note.startswith(f"{KEY}=Qwen/Qwen2.5-7B-Instruct: not in the local Hugging Face "
                           "cache, and HF_HUB_OFFLINE=1 forbids downloading it; estimating "
                           "memlab's shipped config of Qwen2.5-7B-Instruct")
    # the name after the owner decides, whatever its case
    assert Path(config_source(KEY, "qwen/qwen2.5-7b-instruct", None, False)[0]) == SHIPPED_7B


def test_offline_and_unknown_is_one_line_naming_the_fix(offline):
    with pytest.raises(ModelFilesError) as e:
        config_source(KEY, "someone/NoSuchModel-3B", None, False)
    text = str(e.value)
    assert "\n" not in text and not isinstance(e.value, HubUnreachable)
    assert text.startswith(f"{KEY}=someone/NoSuchModel-3B: not in the local Hugging Face cache")
    assert f"{KEY}=DIR" in text and "${memlab.asset:model_configs/NAME}" in text
    assert "Qwen2.5-7B-Instruct" in text and "Llama-3.1-8B-Instruct" in text


def test_a_cached_model_or_a_reachable_hub_is_read_as_named(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(_files, "_cached", lambda repo, revision, filename: True)
    assert config_source(KEY, "Qwen/Qwen2.5-7B-Instruct", None, False) == (
        "Qwen/Qwen2.5-7B-Instruct", None)
    monkeypatch.setattr(_files, "offline", lambda local_files_only: False)  # (tests: offline)
    monkeypatch.setattr(_files, "_cached", lambda repo, revision, filename: False)
    monkeypatch.setattr(_files, "_probe", lambda *a: True)  # the hub answers: it has config.json
    assert config_source(KEY, "Qwen/Qwen2.5-7B-Instruct", None, False) == (
        "Qwen/Qwen2.5-7B-Instruct", None)


def test_an_unreachable_or_gated_hub_falls_back_but_not_found_does_not(monkeypatch):
    monkeypatch.setattr(_files, "offline", lambda local_files_only: False)
    monkeypatch.setattr(_files, "_cached", lambda repo, revision, filename: False)
    monkeypatch.setattr(_files, "_probe", lambda *a: False)  # no answer within the timeout
    where, note = config_source(KEY, "Qwen/Qwen2.5-7B-Instruct", None, False)
    assert Path(where) == SHIPPED_7B and "cannot be reached" in (note or "")

    def gated(key, repo, revision, filename):
        raise HubUnreachable(f"{key}={repo}: a gated model; log in", "a gated model, and this "
                             "login has no access")

    monkeypatch.setattr(_files, "_probe", gated)
    where, note = config_source(KEY, "meta-llama/Llama-3.1-8B-Instruct", None, False)
    assert Path(where).name == "Llama-3.1-8B-Instruct" and "gated" in (note or "")

    def not_found(key, repo, revision, filename):
        raise ModelFilesError(f"{key}={repo}: no such model on the hub")

    monkeypatch.setattr(_files, "_probe", not_found)  # a typo is not answered with a guess
    with pytest.raises(ModelFilesError, match="no such model on the hub"):
        config_source(KEY, "nobody/Qwen2.5-7B-Instruct", None, False)


def test_loading_weights_still_needs_the_hub(offline):
    from memlab.model.hf import HubModel

    with pytest.raises(HubUnreachable, match="HF_HUB_OFFLINE=1 forbids downloading"):
        HubModel(name_or_path="Qwen/Qwen2.5-7B-Instruct")._local_only(
            KEY, "Qwen/Qwen2.5-7B-Instruct", ("config", "weights"), "config.json")
