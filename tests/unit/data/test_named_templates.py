"""Named chat templates (``model.chat_template=<name>``, issue 46 item 2): each renders its
family's stock text for a short conversation (written out below by hand), takes a tool-calling
conversation where the family has tools (its assistant mask exactly the model's turns), is refused
for a tokenizer that lacks its markers as special tokens, and a template that cannot render a row
says which feature it lacks and names the templates that have it. The tokenizers are memlab's
shipped one plus each family's special tokens (the real ones cannot be downloaded here)."""

from __future__ import annotations

import pytest

from memlab.data import chat, templates
from memlab.data.assets import load_tokenizer
from memlab.data.chat import ChatTemplateError
from memlab.model import _files

SPECIAL = {
    "chatml": {}, "qwen2.5": {}, "qwen3": {},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
               "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]},
    "mistral": {"bos_token": "<s>", "eos_token": "</s>",
                "additional_special_tokens": list(templates.NAMED["mistral"].markers)},
    "gemma": {"bos_token": "<bos>", "eos_token": "<end_of_turn>",
              "additional_special_tokens": ["<start_of_turn>"]},
}
SPECIAL["mistral-tekken"] = SPECIAL["mistral"]

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": "Hello!"}]
_CHATML = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there.<|im_end|>\n"
           "<|im_start|>assistant\nHello!<|im_end|>\n")
STOCK = {  # each family's own template's text of CHAT, and what the model writes in it
    "chatml": (_CHATML, "Hello!<|im_end|>"),
    "qwen2.5": (_CHATML, "Hello!<|im_end|>"),
    "qwen3": ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there.<|im_end|>\n"
              "<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n",
              "<think>\n\n</think>\n\nHello!<|im_end|>"),
    "llama3": ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge "
               "Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nHi there.<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>",
               "Hello!<|eot_id|>"),
    # Mistral's own template: the system prompt only in a last user turn that ends the row
    "mistral": ("<s>[INST] Hi there.[/INST] Hello!</s>", " Hello!</s>"),
    "mistral-tekken": ("<s>[INST]Hi there.[/INST]Hello!</s>", "Hello!</s>"),
    "gemma": ("<bos><start_of_turn>user\nBe brief.\n\nHi there.<end_of_turn>\n"
              "<start_of_turn>model\nHello!<end_of_turn>\n", "Hello!<end_of_turn>"),
}

CALL = {"type": "function", "id": "call12345",
        "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}
TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                   "required": ["zone"]}}}]
TOOL_CHAT = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "What time is it?"},
             {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "call12345", "content": "12:00"},
             {"role": "assistant", "content": "It is noon."}]
WRITTEN = {  # what the model writes in TOOL_CHAT: the call, then the answer
    "qwen2.5": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
               "<|im_end|>It is noon.<|im_end|>",
    "qwen3": '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": '
             '{"zone": "UTC"}}\n</tool_call><|im_end|><think>\n\n</think>\n\nIt is noon.'
             "<|im_end|>",
    "llama3": '{"name": "get_time", "parameters": {"zone": "UTC"}}<|eot_id|>It is noon.'
              "<|eot_id|>",
    "mistral": '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}, "id": '
               '"call12345"}]</s> It is noon.</s>',
    "mistral-tekken": '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}, "id": '
                      '"call12345"}]</s>It is noon.</s>',
}


def family_tokenizer(name: str):
    """memlab's shipped tokenizer with the family's special tokens, and its named template."""
    tok = load_tokenizer()
    if SPECIAL[name]:
        tok.add_special_tokens(SPECIAL[name])
    return _files.apply_chat_template_file(tok, name)


def _marked_text(tok, ids: list[int], mask: list[int]) -> str:
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m])


def test_every_family_has_a_template_and_the_names_cover_the_issue():
    assert {"chatml", "llama3", "qwen2.5", "qwen3", "mistral", "gemma"} <= set(templates.NAMED)
    assert set(STOCK) == set(templates.NAMED)
    for named in templates.NAMED.values():
        assert "{% generation %}" in named.text().replace("{%- generation -%}",
                                                          "{% generation %}")


@pytest.mark.parametrize("name", sorted(STOCK))
def test_a_named_template_renders_its_familys_text_and_marks_the_answer(name):
    tok = family_tokenizer(name)
    text, answer = STOCK[name]
    assert tok.apply_chat_template(CHAT, tokenize=False) == text
    ids, mask = chat.assistant_mask(tok, [dict(m) for m in CHAT], 0)
    assert tok.decode(ids) == text
    assert _marked_text(tok, ids, mask) == answer


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_a_tool_calling_conversation_renders_with_only_the_models_turns_trained(name):
    tok = family_tokenizer(name)
    ids, mask = chat.assistant_mask(tok, [dict(m) for m in TOOL_CHAT], 0, tools=TOOLS)
    text = tok.decode(ids)
    assert _marked_text(tok, ids, mask) == WRITTEN[name]
    assert '"description": "The current time in a time zone."' in text  # the schema
    assert "12:00" in text and "What time is it?" in text


@pytest.mark.parametrize("name", ["chatml", "gemma"])
def test_a_template_without_tools_says_so_and_names_those_with_them(name):
    tok = family_tokenizer(name)
    with pytest.raises(ChatTemplateError) as e:
        chat.assistant_mask(tok, [dict(m) for m in TOOL_CHAT], 7, tools=TOOLS)
    message = str(e.value)
    assert message.startswith("row 7: the chat template cannot render field 'messages'")
    assert (f"memlab's {name} template renders no tools, tool calls or tool results, which this "
            "row has") in message
    assert "model.chat_template=<name>: qwen2.5, qwen3, llama3, mistral, mistral-tekken" in message


def test_the_default_tokenizers_template_on_tool_rows_names_templates_with_tools():
    """The issue's report: the stock ChatML of the default model, a raw Jinja error before."""
    tok = load_tokenizer()
    with pytest.raises(ChatTemplateError) as e:
        chat.assistant_mask(tok, [dict(m) for m in TOOL_CHAT], 0, tools=TOOLS)
    assert "this chat template renders no tools, tool calls or tool results" in str(e.value)
    assert "qwen2.5, qwen3" in str(e.value)
    no_system = ("{% if messages[0].role == 'system' %}{{ raise_exception('System role not "
                 "supported') }}{% endif %}")
    assert templates.lacking(no_system, CHAT, None).startswith(
        "; this chat template renders no system turn, which this row has: drop them from the "
        "data, or use a template that renders them (model.chat_template=<name>: chatml, qwen2.5")
    assert templates.lacking(templates.NAMED["chatml"].text(), CHAT, None) == ""


def test_a_named_template_is_refused_for_a_tokenizer_without_its_markers():
    tok = load_tokenizer()  # ChatML's tokens only
    with pytest.raises(_files.ModelFilesError) as e:
        _files.apply_chat_template_file(tok, "llama3")
    message = str(e.value)
    assert message.startswith("model.chat_template=llama3 writes <|start_header_id|>, "
                              "<|end_header_id|>, <|eot_id|>, which the tokenizer does not have "
                              "as single special tokens")
    assert message.endswith("a named template whose markers it has: chatml, qwen2.5, qwen3")
    tok = load_tokenizer()
    tok.add_tokens(["<start_of_turn>", "<end_of_turn>"])  # tokens, but not special ones
    with pytest.raises(_files.ModelFilesError, match="gemma writes <start_of_turn>, "
                                                     "<end_of_turn>, which"):
        _files.apply_chat_template_file(tok, "gemma")


def test_names_and_files_are_validated_and_a_name_is_an_input(tmp_path):
    assert _files.chat_template_errors("model.chat_template", "qwen2.5") == []
    [error] = _files.chat_template_errors("model.chat_template", "qwen25")
    assert "not a template memlab ships; name one (chatml, qwen2.5, qwen3, llama3" in error
    file = tmp_path / "mine.jinja"
    file.write_text("{{ messages[0].content }}")
    assert _files.chat_template_errors("model.chat_template", str(file)) == []
    assert _files.template_inputs("gemma") == _files.template_inputs(
        str(templates.NAMED["gemma"].path))


@pytest.mark.pipeline
def test_tool_rows_train_on_the_default_model_with_a_named_template(job, tmp_path):
    import json

    rows = tmp_path / "tools.jsonl"
    rows.write_text("".join(json.dumps({"messages": TOOL_CHAT, "tools": TOOLS}) + "\n"
                            for _ in range(4)))
    s = job(["data=local", f"data.path={rows}", "train.steps=1", "method.max_length=1024",
             "model.chat_template=qwen2.5"])
    assert s["status"] == "ok", s["error"]
    s = job(["data=local", f"data.path={rows}", "train.steps=1"])
    assert s["status"] == "invalid"
    assert "model.chat_template=<name>: qwen2.5" in s["error"]
