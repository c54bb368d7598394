"""`data=mixture` of sources in different formats (issue 46 item 1): each source converted on its
own (ShareGPT, Alpaca, prompt-completion) and brought to one conversational form before mixing,
its rows equal to its own conversion; a mix no method can read (preference with language
modelling rows) refused naming both sources and why."""

from __future__ import annotations

import dataclasses
import json

import pytest

from memlab.data.base import DataError
from memlab.data.formats import as_conversation, convert
from memlab.data.local import Local
from memlab.data.mixture import Mixture
from memlab.pipeline import prepare_rows

N = 12


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("formats")
    return {
        "sharegpt": _write(d / "sharegpt.jsonl", [{"conversations": [
            {"from": "human", "value": f"sharegpt question {i}"},
            {"from": "gpt", "value": f"sharegpt answer {i}"}]} for i in range(N)]),
        # line 19 of the issue's report: rows after the first have an empty input
        "alpaca": _write(d / "alpaca.jsonl", [{"instruction": f"alpaca task {i}",
                                               "input": "" if i % 2 else f"input {i}",
                                               "output": f"alpaca output {i}"}
                                              for i in range(N)]),
        "messages": _write(d / "messages.jsonl", [{"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"chat question {i}"},
            {"role": "assistant", "content": f"chat answer {i}"}]} for i in range(N)]),
        "completion": _write(d / "completion.jsonl", [{
            "prompt": [{"role": "user", "content": f"pc question {i}"}],
            "completion": [{"role": "assistant", "content": f"pc answer {i}"}]}
            for i in range(N)]),
        "strings": _write(d / "strings.jsonl", [{"prompt": f"string question {i}",
                                                 "completion": f" string answer {i}"}
                                                for i in range(N)]),
        "preference": _write(d / "preference.jsonl", [{"prompt": f"q {i}", "chosen": f"good {i}",
                                                       "rejected": f"bad {i}"}
                                                      for i in range(N)]),
        "implicit": _write(d / "implicit.jsonl", [{"chosen": f"q {i} good", "rejected":
                                                   f"q {i} bad"} for i in range(N)]),
        "text": _write(d / "text.jsonl", [{"text": f"plain text {i}"} for i in range(N)]),
    }


def _mixture(files, *names) -> Mixture:
    return Mixture(sources={n: {"name": "local", "path": files[n], "weight": 1} for n in names})


@pytest.fixture(scope="module")
def sft(files):
    from omegaconf import OmegaConf

    from memlab.context import validate
    from memlab_testing import compose, with_fast

    cfg = OmegaConf.to_container(compose(with_fast(
        ["data=local", f"data.path={files['messages']}", "method.max_length=null"])))
    del cfg["hydra"]
    ctx = validate(OmegaConf.create(cfg))
    return ctx, ctx.model.load_tokenizer(ctx)


def _own(files, name: str):
    """The source's rows converted alone, as data=local converts them."""
    ds, _ = convert(Local(path=files[name]).load(None))
    return ds


def _rows_of(mixed, label: str) -> dict[int, dict]:
    return {r["source_row"]: {k: v for k, v in r.items() if k not in ("source", "source_row")
                              and v is not None}
            for r in mixed if r["source"] == label}


@pytest.mark.parametrize("pair", [("sharegpt", "alpaca"), ("messages", "completion"),
                                  ("messages", "strings")])
def test_each_source_is_converted_alone_then_to_conversations(files, pair):
    mixed = _mixture(files, *pair).load(None)
    assert mixed.column_names == ["messages", "source", "source_row"]
    for name in pair:
        own = _own(files, name)
        if "messages" not in own.column_names:
            own = as_conversation(own)
        got = _rows_of(mixed, name)
        assert len(got) == N
        assert got == {i: dict(own[i]) for i in range(N)}
    alpaca = _rows_of(mixed, pair[1])[1]  # (an empty input adds nothing to the instruction)
    if pair[1] == "alpaca":
        assert alpaca["messages"] == [{"role": "user", "content": "alpaca task 1"},
                                      {"role": "assistant", "content": "alpaca output 1"}]
    if pair[1] == "strings":
        assert alpaca["messages"] == [{"role": "user", "content": "string question 1"},
                                      {"role": "assistant", "content": " string answer 1"}]


def test_string_and_conversational_prompt_completion_mix_as_turns(files):
    mixed = _mixture(files, "completion", "strings").load(None)
    assert {"prompt", "completion"} <= set(mixed.column_names)
    got = _rows_of(mixed, "strings")[3]
    assert got["prompt"] == [{"role": "user", "content": "string question 3"}]
    assert got["completion"] == [{"role": "assistant", "content": " string answer 3"}]
    assert _rows_of(mixed, "completion")[3] == dict(_own(files, "completion")[3])


def test_the_tokens_of_each_source_are_its_own(files, sft):
    """ShareGPT rows tokenize as the ShareGPT file alone; Alpaca rows as the Alpaca file alone
    (the same ids; the loss on the same answer tokens up to the end-of-turn token: alone, as
    prompt-completion, it also trains ChatML's newline after it)."""
    ctx, tok = sft

    def prepared(data):
        raw, ds, _, _ = prepare_rows(dataclasses.replace(ctx, data=data), tok)
        return raw, ds

    _, mixed_ds = raw_and = prepared(_mixture(files, "sharegpt", "alpaca"))
    raw = raw_and[0]
    alone = {n: prepared(Local(path=files[n]))[1] for n in ("sharegpt", "alpaca")}
    newline = tok.encode("\n", add_special_tokens=False)
    for i in range(len(raw)):
        label, row = raw[i]["source"], raw[i]["source_row"]
        own, got = alone[label][row], mixed_ds[i]
        assert got["input_ids"] == own["input_ids"]
        want = list(own["labels"])
        if label == "alpaca":  # the separator after <|im_end|>: trained alone, not here
            assert want[-2] == newline[0] and got["labels"][-2] == -100
            want[-2] = -100
        assert got["labels"] == want


@pytest.mark.parametrize(("pair", "why"), [
    (("messages", "preference"), "a preference row trains its chosen answer against its "
                                 "rejected one"),
    (("alpaca", "preference"), "a preference row"),
    (("preference", "implicit"), "an implicit prompt"),
    (("text", "messages"), "one gives strings, the other lists of messages"),
    (("text", "strings"), "plain text rows ('text') are trained whole"),
])
def test_sources_that_cannot_mix_are_refused_naming_both(files, pair, why):
    with pytest.raises(DataError) as e:
        _mixture(files, *pair).load(None)
    message = str(e.value)
    a, b = sorted(pair)
    assert message.startswith(f"mixture sources {a!r} and {b!r} cannot be mixed: ")
    assert why in message
    assert "docs/config/data.md" in message


@pytest.mark.pipeline
def test_sharegpt_and_alpaca_train_and_preference_with_chat_is_invalid(job, files):
    s = job(["data=mixture", "train.steps=2",
             f"+data.sources.sharegpt={{name: local, path: '{files['sharegpt']}', weight: 1}}",
             f"+data.sources.alpaca={{name: local, path: '{files['alpaca']}', weight: 1}}"])
    assert s["status"] == "ok", s["error"]
    assert s["data"]["sources"] == {"alpaca": {"rows": N, "weight": 1},
                                    "sharegpt": {"rows": N, "weight": 1}}
    s = job(["data=mixture", "train.steps=1",
             f"+data.sources.chat={{name: local, path: '{files['messages']}', weight: 1}}",
             f"+data.sources.pc={{name: local, path: '{files['completion']}', weight: 1}}"])
    assert s["status"] == "ok", s["error"]
    s = job(["data=mixture", "train.steps=1",
             f"+data.sources.chat={{name: local, path: '{files['messages']}', weight: 1}}",
             f"+data.sources.pairs={{name: local, path: '{files['preference']}', weight: 1}}"])
    assert s["status"] == "invalid"
    assert "mixture sources 'chat' and 'pairs' cannot be mixed" in s["error"]
