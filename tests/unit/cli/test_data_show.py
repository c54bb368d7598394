"""``memlab data show``: rows as the trainer receives them, built from the collated batch; the
marked tokens are exactly those a label scores (token p marked <=> labels[p - 1] is not ignored,
plus the fork-scored first tokens of shared-prompt completions), and they decode to the
assistant answers; documents name their example and what truncation did to it."""

from __future__ import annotations

import json

import pytest

from memlab.cli.data import main
from memlab.cli.data.show import format_report, inspect, marked_text
from memlab.losses import IGNORE
from memlab.pipeline import batch_stream, prepare_data


def _ctx(*overrides):
    from omegaconf import OmegaConf

    from memlab.context import validate
    from memlab_testing import compose, with_fast

    cfg = compose(with_fast(["data.n_examples=12", "data.median_tokens=40", *overrides]))
    cfg = OmegaConf.to_container(cfg)
    del cfg["hydra"]
    ctx = validate(OmegaConf.create(cfg))
    return ctx, ctx.model.load_tokenizer(ctx)


def _expected_marks(ctx, tok, n_rows):
    """Marked positions computed from the batches the trainer's stream gives, row by row."""
    ds, _ = prepare_data(ctx, tok)
    stream = batch_stream(ctx, tok, ds)
    out = []
    while len(out) < n_rows:
        t = next(stream).tensors
        for r in range(t["input_ids"].shape[0]):
            labels = t["labels"][r].tolist()
            marks = {p for p in range(1, len(labels)) if labels[p - 1] != IGNORE}
            if "fork_index" in t:  # the prompt's last token scores each later completion
                width = t["input_ids"].shape[1]
                for flat in t["fork_index"].tolist():
                    if flat // width == r:
                        marks.add(flat % width + 1 + _gap(t["segments"], r, flat % width))
            out.append((t["input_ids"][r].tolist(), marks))
    return out[:n_rows]


def _gap(segments, row, last_prompt_token):
    """Tokens between the shared prompt's end and the completion it forks to."""
    for start, _, prefix in segments.documents(row):
        if prefix is not None and prefix[1] == last_prompt_token + 1 and start > prefix[1]:
            return start - prefix[1]
    return 0


@pytest.mark.parametrize("overrides", [
    [],                                                     # padded rows, no attention mask
    ["packing=bfd", "method.max_length=256"],               # packed, padding-free
    ["method=dpo", "method.share_prompt=true", "method.max_length=256"],  # forks
], ids=["sft-padded", "sft-bfd", "dpo-shared-prompt"])
def test_marked_tokens_are_exactly_the_labelled_ones(overrides):
    ctx, tok = _ctx(*overrides)
    report = inspect(ctx, tok, 3)
    expected = _expected_marks(ctx, tok, 3)
    assert len(report.rows) == 3
    for row, (ids, marks) in zip(report.rows, expected, strict=True):
        assert row.ids == ids and row.marked == marks and marks
        assert sum(d.end - d.start for d in row.documents) + row.padding == len(ids)
    if ctx.method.name == "sft":  # the marked runs are the assistant answers, end of turn incl.
        for row in report.rows:
            for doc in row.documents:
                runs = marked_text(tok, row.ids[doc.start:doc.end],
                                   {p - doc.start for p in row.marked}, "[[", "]]")
                assert "]]" in runs and all(run.split("]]")[0].endswith("<|im_end|>")
                                            for run in runs.split("[[")[1:]
                                            if not doc.notes or "truncated" not in doc.notes[0])


def test_documents_are_traced_with_their_truncation():
    ctx, tok = _ctx("method.max_length=64")
    report = inspect(ctx, tok, 2)
    from memlab.data.synthetic import generate_chat

    rows = generate_chat(12, seed=0, median_tokens=40, max_tokens=6000)
    for row in report.rows:
        (doc,) = row.documents
        k = int(doc.origin.split("generated example ")[1].split(" ")[0])
        full = len(tok.apply_chat_template(rows[k]["messages"], tokenize=True,
                                           return_dict=True)["input_ids"])
        if full > 64:
            assert doc.notes == [f"truncated from {full} tokens"]
        else:
            assert doc.notes == [] and doc.end - doc.start == full


@pytest.mark.pipeline
def test_converted_and_skipped_rows_are_reported(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEMLAB_CPU_BF16", "0")  # checks no precision: as on any CPU
    rows = [{"conversations": [{"from": "human", "value": f"question {i}"},
                               {"from": "gpt", "value": f"answer {i}"}]} for i in range(3)]
    rows.insert(1, {"conversations": [{"from": "gpt", "value": "an answer with no question"}]})
    path = tmp_path / "sharegpt.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = tmp_path / "chatml.jinja"  # no generation markers: split turn by turn
    template.write_text("{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + "
                        "m.content + '<|im_end|>\\n' -}}{%- endfor -%}{%- if "
                        "add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
                        "{%- endif -%}")
    common = ["show", "data=local", f"data.path={path}", f"model.chat_template={template}"]
    assert main([*common, "data.on_unsplittable=skip", "--rows", "2", "--no-color"]) == 0
    out = capsys.readouterr().out
    assert "converted on load: sharegpt (4 rows)" in out
    assert f"skipped: 1 rows the chat template cannot split (first: {path} line 2)" in out
    assert "[[answer " in out and "<|im_end|>]]" in out and f"{path} line " in out
    assert main([*common, "--rows", "1"]) == 2
    assert f"{path} line 2: row 1: field 'messages'" in capsys.readouterr().err


def test_cli_help_and_colour(capsys):
    with pytest.raises(SystemExit) as e:
        main(["show", "--help"])
    assert e.value.code == 0 and "--rows N" in capsys.readouterr().out
    ctx, tok = _ctx()
    report = inspect(ctx, tok, 1)
    coloured = format_report(report, tok, color=True, max_chars=None)
    assert "\x1b[1;32m" in coloured and "[[" not in coloured
