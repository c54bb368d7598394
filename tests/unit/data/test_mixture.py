"""`data=mixture`: data configs as sources (a local file and a hub dataset read offline from a
``datasets`` cache the test builds), in shares set by weights or counts, seeded; rows per source
in the summary's data section; a bad row named by its source, file and line."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter

import numpy as np
import pytest

from memlab.data.base import DataError
from memlab.data.mixture import Mixture, plan, take
from memlab.pipeline import prepare_rows


def _chat(i: int, tag: str) -> dict:
    return {"messages": [{"role": "user", "content": f"{tag} question {i}"},
                         {"role": "assistant", "content": f"{tag} answer {i}"}]}


def offline_hub(cache_dir, repo: str, rows: list[dict]) -> None:
    """``repo`` in a ``datasets`` cache at ``cache_dir``, as a download would leave it, so that
    ``load_dataset(repo, cache_dir=cache_dir)`` reads it with HF_DATASETS_OFFLINE=1."""
    from datasets.packaged_modules.json.json import Json

    owner, name = repo.split("/")
    source = cache_dir / f"{name}.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    builder = Json(cache_dir=str(cache_dir), dataset_name=name, config_name="default",
                   data_files={"train": [str(source)]}, hash="0123abcd")
    builder.download_and_prepare()
    built = next((cache_dir / name).glob("default*"))
    (cache_dir / f"{owner}___{name}").mkdir()
    shutil.move(str(built), str(cache_dir / f"{owner}___{name}" / "default"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    import os

    assert os.environ.get("HF_DATASETS_OFFLINE") == "1"  # memlab_testing: no network
    folder = tmp_path_factory.mktemp("mixture")
    local = folder / "chat.jsonl"
    local.write_text("".join(json.dumps(_chat(i, "local")) + "\n" for i in range(30)))
    cache = folder / "hub-cache"
    cache.mkdir()
    offline_hub(cache, "memlab-tests/tiny-chat", [_chat(i, "hub") for i in range(10)])
    return {"chat": {"name": "local", "path": str(local)},
            "hub": {"name": "hub", "path": "memlab-tests/tiny-chat", "cache_dir": str(cache)}}


@pytest.fixture(scope="module")
def sft(sources):
    from omegaconf import OmegaConf

    from memlab.context import validate
    from memlab_testing import compose, with_fast

    cfg = compose(with_fast(["data=mixture", "method.max_length=null",
                             f"+data.sources.a={{name: local, path: '{sources['chat']['path']}'"
                             ", weight: 1}"]))
    cfg = OmegaConf.to_container(cfg)
    del cfg["hydra"]
    ctx = validate(OmegaConf.create(cfg))
    return ctx, ctx.model.load_tokenizer(ctx)


def _mix(sft, sources, shares: dict, **kw):
    ctx, tok = sft
    mixture = Mixture(sources={k: {**sources[k], **v} for k, v in shares.items()}, **kw)
    assert mixture.validate(ctx) == []
    ctx = dataclasses.replace(ctx, data=mixture)
    raw, ds, stats, _ = prepare_rows(ctx, tok)
    texts = [tok.decode(ids) for ids in ds["input_ids"]]
    return raw, stats, texts


def test_plan_splits_by_weight_without_repeating_and_adds_counts():
    sizes = {"a": 30, "b": 10, "c": 5}
    assert plan(sizes, {"a": 1, "b": 1}, {}, None) == {"a": 10, "b": 10}  # b runs out first
    assert plan(sizes, {"a": 3, "b": 1}, {}, None) == {"a": 30, "b": 10}
    assert plan(sizes, {"a": 2, "b": 1}, {"c": 7}, 10) == {"a": 7, "b": 3, "c": 7}
    assert plan(sizes, {"a": 1, "b": 1, "c": 1}, {}, 10) == {"a": 4, "b": 3, "c": 3}
    rng = np.random.default_rng(0)
    picked = take(4, 10, rng)  # more rows than the source has: whole passes, each row once
    assert Counter(picked[:8]) == Counter(list(range(4)) * 2) and len(picked) == 10


def test_local_and_offline_hub_sources_in_weighted_shares(sft, sources):
    raw, stats, texts = _mix(sft, sources, {"chat": {"weight": 2}, "hub": {"weight": 1}})
    assert stats.extra["sources"] == {"chat": {"rows": 20, "weight": 2},
                                      "hub": {"rows": 10, "weight": 1}}
    assert sum("hub answer" in t for t in texts) == 10 and len(texts) == 30
    assert len({t for t in texts if "hub answer" in t}) == 10  # every hub row once
    again = _mix(sft, sources, {"chat": {"weight": 2}, "hub": {"weight": 1}})[2]
    other = _mix(sft, sources, {"chat": {"weight": 2}, "hub": {"weight": 1}}, seed=1)[2]
    assert again == texts and other != texts and sorted(other) != sorted(texts)


def test_counts_repeat_a_small_source(sft, sources):
    _, stats, texts = _mix(sft, sources, {"chat": {"count": 5}, "hub": {"count": 25}})
    assert stats.extra["sources"]["hub"] == {"rows": 25, "count": 25}
    hub = Counter(t for t in texts if "hub answer" in t)
    assert len(hub) == 10 and sorted(hub.values()) == [2] * 5 + [3] * 5


def test_a_bad_row_is_named_by_source_file_and_line(sft, sources, tmp_path):
    bad = tmp_path / "bad.jsonl"
    rows = [_chat(i, "bad") for i in range(4)]
    rows[2]["messages"][1]["role"] = "robot"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sources = {**sources, "bad": {"name": "local", "path": str(bad)}}
    with pytest.raises(DataError, match=rf"mixture source 'bad': {bad} line 3: row \d+: field "
                                        r"'messages'\[1\]\.role must be"):
        _mix(sft, sources, {"hub": {"count": 3}, "bad": {"count": 4}})


def test_source_configs_are_validated():
    mixture = Mixture(sources={
        "both": {"name": "local", "path": "x.jsonl", "weight": 1, "count": 2},
        "none": {"name": "hub"},
        "nested": {"name": "mixture", "weight": 1},
        "kwargs": {"name": "embedded", "weight": 1, "chat_template_kwargs": {"x": 1}},
        "typo": {"name": "embedded", "count": 2, "n_exampels": 3},
        "zero": {"name": "embedded", "weight": 0},
    })
    _, errors = mixture.source_configs()
    text = "\n".join(errors)
    for needle in ("data.sources.both needs exactly one of weight", "data.sources.none needs",
                   "data.sources.nested: a mixture cannot be a source",
                   "data.sources.kwargs.chat_template_kwargs: this setting is the mixture's", "unknown key 'n_exampels'", "data.sources.zero.weight must be"):
        assert needle in text, text


@pytest.mark.pipeline
def test_a_mixture_run_records_rows_per_source(job, sources):
    chat, hub = sources["chat"], sources["hub"]
    s = job(["data=mixture", "train.steps=1",
             f"+data.sources.chat={{name: local, path: '{chat['path']}', weight: 1}}",
             f"+data.sources.hub={{name: hub, path: {hub['path']}, cache_dir: "
             f"'{hub['cache_dir']}', count: 4}}", "data.max_examples=6"])
    assert s["status"] == "ok", s["error"]
    assert s["data"]["sources"] == {"chat": {"rows": 6, "weight": 1},
                                    "hub": {"rows": 4, "count": 4}}
    assert s["data"]["examples"] == 10
