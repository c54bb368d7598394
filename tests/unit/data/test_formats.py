"""Every dataset type of TRL's dataset-formats guide, standard and conversational, for every
method that takes it, plus ShareGPT, Alpaca, content parts, tool calls, per-row tools, template
variables and renamed columns: each read from a small file the test writes, through the run's
own data path (:func:`memlab.pipeline.prepare_rows`), and compared with token ids computed
independently from the tokenizer and its chat template."""

from __future__ import annotations

import dataclasses
import json

import pytest

from memlab.data.base import DataError
from memlab.data.local import Local
from memlab.method.base import IGNORE
from memlab.pipeline import prepare_rows

Q, A = "What is two plus two?", "It is four."
CONV = [{"role": "user", "content": Q}, {"role": "assistant", "content": A}]
TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}]
TOOL_CONV = [
    {"role": "user", "content": [{"type": "text", "text": "What time "},
                                 {"type": "text", "text": "is it?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]},
    {"role": "tool", "content": "12:00"},
    {"role": "assistant", "content": "It is noon."},
]
# Qwen2.5-style: tools in the system turn, JSON tool calls, tool results in a user turn
TOOLS_TEMPLATE = (
    "{%- if greeting is defined -%}{{- greeting + '\\n' -}}{%- endif -%}"
    "{%- if tools -%}{{- '<|im_start|>system\\nTools:' -}}"
    "{%- for t in tools -%}{{- '\\n' + t | tojson -}}{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if m.content -%}{{- m.content -}}{%- endif -%}"
    "{%- for c in m.tool_calls or [] -%}{{- '<tool_call>' + c.function.name + ' ' + "
    "c.function.arguments | tojson + '</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}{{- '<|im_start|>user\\n<tool_response>' + m.content + "
    "'</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A validated context per method (composed once), a tokenizer per chat template."""
    from omegaconf import OmegaConf

    from memlab.context import validate
    from memlab_testing import compose, with_fast

    folder = tmp_path_factory.mktemp("formats")
    dummy = folder / "dummy.jsonl"
    dummy.write_text(json.dumps({"text": "x"}) + "\n")
    template = folder / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    contexts: dict[tuple[str, bool], object] = {}
    tokenizers: dict[bool, object] = {}

    def get(method: str, tools_template: bool = False):
        key = (method, tools_template)
        if key not in contexts:
            extra = [f"model.chat_template={template}"] if tools_template else []
            cfg = compose(with_fast([f"method={method}", "data=local", f"data.path={dummy}",
                                     *extra]))
            cfg = OmegaConf.to_container(cfg)
            del cfg["hydra"]
            contexts[key] = validate(OmegaConf.create(cfg))
        ctx = contexts[key]
        if tools_template not in tokenizers:
            tokenizers[tools_template] = ctx.model.load_tokenizer(ctx)
        return ctx, tokenizers[tools_template]

    return get, folder


def _prepare(base, rows: list[dict], method: str = "sft", tools_template: bool = False,
             name: str = "rows", **data):
    get, folder = base
    ctx, tok = get(method, tools_template)
    path = folder / f"{name}-{method}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ctx = dataclasses.replace(ctx, data=Local(path=str(path), **data))
    _, ds, stats, _ = prepare_rows(ctx, tok)
    return ds, stats, tok


def _text(tok, s: str) -> list[int]:
    return list(tok(s, add_special_tokens=False)["input_ids"])


def _chat(tok, messages, generation_prompt=False, **kw) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        add_generation_prompt=generation_prompt,
                                        **kw)["input_ids"])


def _trained(row: dict) -> list[int]:
    ids, labels = row["input_ids"], row["labels"]
    return [ids[t + 1] for t in range(len(ids) - 1) if labels[t] != IGNORE]


# ----------------------------------------------------------------------------------- types


def test_language_modeling_standard_and_conversational(base):
    ds, _, tok = _prepare(base, [{"text": Q + " " + A}], name="lm-standard")
    ids = _text(tok, Q + " " + A) + [tok.eos_token_id]
    assert ds[0]["input_ids"] == ids and _trained(ds[0]) == ids[1:]
    ds, _, tok = _prepare(base, [{"messages": CONV}], name="lm-conv")
    assert ds[0]["input_ids"] == _chat(tok, CONV)
    assert tok.decode(_trained(ds[0])) == A + "<|im_end|>"
    for method in ("gkd", "grpo"):  # conversations are what GKD trains on, and prompts online
        ds, _, tok = _prepare(base, [{"messages": CONV}], method, name="lm-conv")
        assert ds[0]["prompt_ids"] == _chat(tok, CONV[:1], generation_prompt=True)
    assert tok.decode(ds[0]["prompt_ids"]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("method", ["grpo", "rloo", "online_dpo"])
def test_prompt_only_standard_and_conversational(base, method):
    ds, _, tok = _prepare(base, [{"prompt": Q}], method, name="po-standard")
    assert ds[0]["prompt_ids"] == _text(tok, Q)
    ds, _, tok = _prepare(base, [{"prompt": CONV[:1]}], method, name="po-conv")
    assert ds[0]["prompt_ids"] == _chat(tok, CONV[:1], generation_prompt=True)


def test_prompt_completion_standard_and_conversational(base):
    ds, _, tok = _prepare(base, [{"prompt": Q, "completion": " " + A}], name="pc-standard")
    assert ds[0]["input_ids"] == _text(tok, Q) + _text(tok, " " + A) + [tok.eos_token_id]
    assert _trained(ds[0]) == _text(tok, " " + A) + [tok.eos_token_id]
    ds, _, tok = _prepare(base, [{"prompt": CONV[:1], "completion": CONV[1:]}], name="pc-conv")
    assert ds[0]["input_ids"] == _chat(tok, CONV)
    prompt = _chat(tok, CONV[:1], generation_prompt=True)
    assert _trained(ds[0]) == _chat(tok, CONV)[len(prompt):]


PAIRS = {  # (rows, prompt, chosen, rejected) of each variant, as text the tokenizer renders
    "explicit-standard": ([{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}],
                          "The sky is", " blue.", " green."),
    "implicit-standard": ([{"chosen": "The sky is blue.", "rejected": "The sky is green."}],
                          "The sky is", " blue.", " green."),
    "explicit-conversational": ([{"prompt": CONV[:1], "chosen": CONV[1:],
                                  "rejected": [{"role": "assistant", "content": "Five."}]}],
                                None, A, "Five."),
    "implicit-conversational": ([{"chosen": CONV, "rejected": [CONV[0], {"role": "assistant",
                                                                         "content": "Five."}]}],
                                None, A, "Five."),
}


@pytest.mark.parametrize("variant", sorted(PAIRS))
@pytest.mark.parametrize("method", ["dpo", "kto", "reward"])
def test_preference_explicit_and_implicit_prompt(base, method, variant):
    rows, prompt, chosen, rejected = PAIRS[variant]
    ds, _, tok = _prepare(base, rows, method, name=f"pref-{variant}")
    if prompt is None:  # conversational: the chat template renders prompt and answers
        p = _chat(tok, CONV[:1], generation_prompt=True)
        full = {"chosen": _chat(tok, CONV), "rejected": _chat(tok, [CONV[0], {
            "role": "assistant", "content": rejected}])}
        want = {k: v[len(p):] for k, v in full.items()}
    else:
        p = _text(tok, prompt)
        want = {"chosen": _text(tok, chosen) + [tok.eos_token_id],
                "rejected": _text(tok, rejected) + [tok.eos_token_id]}
    if method == "dpo":
        assert ds[0]["prompt_ids"] == p
        assert (ds[0]["chosen_ids"], ds[0]["rejected_ids"]) == (want["chosen"], want["rejected"])
    elif method == "kto":  # a pair becomes one desirable and one undesirable example
        got = {bool(r["label"]): (r["prompt_ids"], r["completion_ids"]) for r in ds}
        assert got == {True: (p, want["chosen"]), False: (p, want["rejected"])}
    else:  # reward: whole sequences
        whole = ([] if variant.startswith("implicit-standard") else p)
        if variant == "implicit-standard":  # no prompt column: each text is one document
            want = {k: _text(tok, r) + [tok.eos_token_id]
                    for k, r in (("chosen", rows[0]["chosen"]),
                                 ("rejected", rows[0]["rejected"]))}
        assert (ds[0]["chosen_ids"], ds[0]["rejected_ids"]) == (whole + want["chosen"],
                                                                whole + want["rejected"])


def test_unpaired_preference_standard_and_conversational(base):
    rows = [{"prompt": "The sky is", "completion": " blue.", "label": True},
            {"prompt": "The sky is", "completion": " green.", "label": False}]
    ds, _, tok = _prepare(base, rows, "kto", name="unpaired-standard")
    assert [(r["prompt_ids"], r["completion_ids"], r["label"]) for r in ds] == [
        (_text(tok, "The sky is"), _text(tok, " blue.") + [tok.eos_token_id], True),
        (_text(tok, "The sky is"), _text(tok, " green.") + [tok.eos_token_id], False)]
    rows = [{"prompt": CONV[:1], "completion": CONV[1:], "label": True}]
    ds, _, tok = _prepare(base, rows, "kto", name="unpaired-conv")
    p = _chat(tok, CONV[:1], generation_prompt=True)
    assert (ds[0]["prompt_ids"], ds[0]["completion_ids"]) == (p, _chat(tok, CONV)[len(p):])


# ----------------------------------------------------------------------------------- conversions


def test_sharegpt_alpaca_content_parts_and_renamed_columns_convert_to_the_same_tokens(base):
    want, _, _ = _prepare(base, [{"messages": [{"role": "system", "content": "Be brief."},
                                               *CONV]}], name="native")
    sharegpt = [{"conversations": [{"from": "system", "value": "Be brief."},
                                   {"from": "human", "value": Q}, {"from": "gpt", "value": A}]}]
    system_column = [{"system": "Be brief.", "conversations": [{"from": "human", "value": Q},
                                                               {"from": "gpt", "value": A}]}]
    parts = [{"messages": [{"role": "system", "content": [{"type": "text", "text": "Be "},
                                                          {"type": "text", "text": "brief."}]},
                           *CONV]}]
    renamed = [{"dialog": [{"role": "system", "content": "Be brief."}, *CONV], "id": 7}]
    for name, rows, kw, converted in (("sharegpt", sharegpt, {}, {"sharegpt": 1}),
                                      ("system", system_column, {},
                                       {"sharegpt": 1, "system": 1}),
                                      ("parts", parts, {}, None),
                                      ("renamed", renamed, {"columns": {"dialog": "messages"}},
                                       {"columns": 1})):
        ds, stats, _ = _prepare(base, rows, name=name, **kw)
        assert ds[0] == want[0], name
        assert stats.extra.get("converted") == converted, name
    alpaca = [{"instruction": "Add the numbers.", "input": "2 and 2", "output": A, "system": "S"},
              {"instruction": Q, "input": "", "output": A}]
    ds, stats, tok = _prepare(base, alpaca, name="alpaca")
    assert stats.extra["converted"] == {"alpaca": 2}
    first = [{"role": "system", "content": "S"},
             {"role": "user", "content": "Add the numbers.\n\n2 and 2"}]
    assert ds[0]["input_ids"] == _chat(tok, first + CONV[1:])
    assert ds[1]["input_ids"] == _chat(tok, CONV)


def test_tool_calls_tool_role_per_row_tools_and_template_variables(base):
    rows = [{"messages": TOOL_CONV, "tools": TOOLS},
            {"messages": TOOL_CONV, "tools": json.dumps(TOOLS)},  # a JSON string works too
            {"messages": CONV, "tools": None}]
    ds, _, tok = _prepare(base, rows, tools_template=True, name="tools",
                          chat_template_kwargs={"greeting": "Hi!"})
    text = tok.decode(ds[0]["input_ids"])
    assert text.startswith("Hi!\n<|im_start|>system\nTools:\n" + json.dumps(TOOLS[0]))
    assert '<tool_call>get_time {"zone": "UTC"}</tool_call>' in text
    assert "<tool_response>12:00</tool_response>" in text
    assert "What time is it?" in text  # the content parts, joined
    assert tok.decode(_trained(ds[0])) == ('<tool_call>get_time {"zone": "UTC"}</tool_call>'
                                           "<|im_end|>It is noon.<|im_end|>")
    assert ds[1] == ds[0]
    assert "Tools" not in tok.decode(ds[2]["input_ids"])  # a row without tools


def test_reasoning_content_is_rendered_where_the_template_reads_it(base, tmp_path):
    from memlab.data.templates import TEMPLATE_DIR

    rows = [{"messages": [CONV[0], {**CONV[1], "reasoning_content": "Two and two."}]}]
    with pytest.raises(DataError, match=r"line 1: row 0: field 'messages'\[1\]"
                                        r"\.reasoning_content is set, but the chat template"):
        _prepare(base, rows, name="reasoning")
    get, folder = base
    ctx, _ = get("sft")
    tok = ctx.model.load_tokenizer(ctx)
    tok.chat_template = (TEMPLATE_DIR / "qwen3.jinja").read_text()
    path = folder / "reasoning-qwen3.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    _, ds, _, _ = prepare_rows(dataclasses.replace(ctx, data=Local(path=str(path))), tok)
    assert tok.decode(_trained(ds[0])) == f"<think>\nTwo and two.\n</think>\n\n{A}<|im_end|>"


def test_invalid_rows_name_file_line_and_field(base):
    bad = [{"conversations": [{"from": "human", "value": Q}, {"from": "robot", "value": A}]}]
    with pytest.raises(DataError, match=r"bad-sft\.jsonl line 1: row 0: field "
                                        r"'messages'\[1\]\.from must be one of"):
        _prepare(base, bad, name="bad")
    parts = [{"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]}]
    with pytest.raises(DataError, match=r"line 1: row 0: field 'messages'\[0\]\.content\[0\] "
                                        r"is a 'image' part"):
        _prepare(base, parts, name="image")
    with pytest.raises(DataError, match="data.columns renames \\['question'\\], which the data "
                                        "does not have"):
        _prepare(base, [{"text": Q}], name="cols", columns={"question": "prompt"})
    with pytest.raises(DataError, match="line 1: row 0: field 'tools' is a string but not JSON"):
        _prepare(base, [{"messages": CONV, "tools": "[{"}], name="tools-bad")


def test_shared_fields_are_validated_with_the_config():
    errors = Local(path="x", columns={"q": "question"}, chat_template_kwargs={"tools": 1,
                                                                                "ok": 2}).row_errors()
    assert len(errors) == 2
    assert "maps onto names memlab does not read" in errors[0] and "messages" in errors[0]
    assert "['tools'] cannot be template variables" in errors[1]
