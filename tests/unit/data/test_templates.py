"""memlab's training templates (memlab.data.templates): applied where a stock template cannot
be split, rendering the stock text wherever markers alone suffice, and exactly the documented
difference where they cannot (Qwen3's earlier reasoning); rows that no template splits are
refused by default or skipped and counted.

The stock templates here are written for these tests: Qwen3's in the style of the stock one
(reasoning dropped before the last user message, tools in the system turn, JSON tool calls);
Mistral v0.3's is the training template without its markers, checked token for token against
Mistral's own encoder (mistral-common, with a real v3 tokenizer file) on system prompts, tools,
tool calls and multi-turn conversations. With a real stock template in the local Hugging Face
cache, ``test_real_stock_templates_from_the_local_cache`` checks it too."""

from __future__ import annotations

import re

import pytest

from memlab.data import chat, templates
from memlab.data.assets import load_tokenizer
from memlab.data.base import DataError

QWEN3_STOCK = (
    "{%- if tools -%}{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}{%- endif -%}"
    # the last user message that is not a wrapped tool response: reasoning is kept after it
    "{%- set ns = namespace(look=true, last=messages | length - 1) -%}"
    "{%- for m in messages[::-1] -%}{%- set i = messages | length - 1 - loop.index0 -%}"
    "{%- if ns.look and m.role == 'user' and not (m.content.startswith('<tool_response>') and "
    "m.content.endswith('</tool_response>')) -%}{%- set ns.look = false -%}"
    "{%- set ns.last = i -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set c = m.content if m.content is string else '' -%}{%- set r = '' -%}"
    "{%- if m.reasoning_content is string -%}{%- set r = m.reasoning_content -%}"
    "{%- elif '</think>' in c -%}"
    "{%- set r = c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last and (loop.last or r) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' + "
    "c.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + c -}}{%- endif -%}"
    "{%- for t in m.tool_calls or [] -%}"
    "{%- if (loop.first and c) or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set f = t.function if t.function else t -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' -}}"
    "{%- if f.arguments is string -%}{{- f.arguments -}}{%- else -%}"
    "{{- f.arguments | tojson -}}{%- endif -%}{{- '}\\n</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)

CALL = {"type": "function", "id": "abcDEF123",
        "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}
TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "The time.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}]
U1, U2 = {"role": "user", "content": "2 + 2?"}, {"role": "user", "content": "And 3 + 3?"}
SYSTEM = {"role": "system", "content": "Answer briefly."}
A_THINK = {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}
A_INLINE = {"role": "assistant", "content": "<think>\nThree and three.\n</think>\n\n6"}
A_PLAIN = {"role": "assistant", "content": "6"}
TOOL_TURN = [{"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "content": "12:00"}]

ONE_TURN = {  # the stock Qwen3 template splits these: one assistant turn
    "plain": ([U1, A_PLAIN], None), "system": ([SYSTEM, U1, A_THINK], None),
    "inline reasoning": ([U1, A_INLINE], None),
    "tool call last": ([U1, {"role": "assistant", "content": "", "tool_calls": [CALL]}], TOOLS),
}
MULTI_TURN = {  # ... and not these
    "two turns": ([U1, A_THINK, U2, A_INLINE], None),
    "no reasoning": ([SYSTEM, U1, A_PLAIN, U2, A_PLAIN], None),
    "tool trajectory": ([U1, *TOOL_TURN, {"role": "assistant", "content": "Noon."}], TOOLS),
}


def _qwen3():
    tok = load_tokenizer()
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tok.chat_template = QWEN3_STOCK
    return tok


def _render(tok, msgs, tools=None, template=None, **kw) -> str:
    return tok.apply_chat_template(msgs, tools=tools, chat_template=template, tokenize=False,
                                   **kw)


def _answers(tok, ids, mask) -> list[str]:
    out, i = [], 0
    while i < len(mask):
        j = i
        while j < len(mask) and mask[j] == mask[i]:
            j += 1
        if mask[i]:
            out.append(tok.decode(ids[i:j], skip_special_tokens=False))
        i = j
    return out


def _without_dropped_reasoning(text: str, msgs: list[dict]) -> str:
    """The training template's text with what Qwen3's own template leaves out removed: the
    think block of every assistant turn before the last user message, and the empty think
    block of a later turn that is neither the last nor has reasoning (the documented
    difference, module docstring of memlab.data.templates)."""
    last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    blocks = re.split(r"(<\|im_start\|>assistant\n)", text)
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    out, k = blocks[0], 0
    for head, body in zip(blocks[1::2], blocks[2::2], strict=True):
        i = turns[k]
        think = re.match(r"<think>\n(.*?)\n</think>\n\n", body, re.S)
        drop = i < last_user or (i != len(msgs) - 1 and not think.group(1))
        out += head + (body[think.end():] if drop else body)
        k += 1
    return out


# ----------------------------------------------------------------------------------- Qwen3


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_qwen3_one_turn_rows_render_the_stock_text_with_the_stock_mask(kwargs):
    """With ``enable_thinking=false`` the stock generation prompt closes an empty think block,
    so a row WITH reasoning cannot be split by it either: those go to the training template."""
    tok = _qwen3()
    found, why = templates.for_tokenizer(tok, kwargs)
    assert found is not None and found.name == "qwen3", why
    with chat.rendering(tok, _Options(kwargs)) as tally:
        for k, (name, (msgs, tools)) in enumerate(ONE_TURN.items()):
            ids, mask = chat.assistant_mask(tok, msgs, k, tools=tools)
            marked = tok.apply_chat_template(msgs, tools=tools, chat_template=found.text,
                                             tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True, **kwargs)
            assert _render(tok, msgs, tools, found.text, **kwargs) == _render(tok, msgs, tools,
                                                                             **kwargs), name
            assert (list(marked["input_ids"]), list(marked["assistant_masks"])) == (
                ids, mask), name
    reasoning = [k for k, (msgs, _) in enumerate(ONE_TURN.values())
                 if "think" in str(msgs[-1]) or msgs[-1].get("reasoning_content")]
    assert tally.template_rows == (reasoning if kwargs else [])  # others: the stock split them


def test_qwen3_multi_turn_rows_use_the_training_template_and_differ_only_as_documented():
    tok = _qwen3()
    with chat.rendering(tok) as tally:
        for k, (name, (msgs, tools)) in enumerate(MULTI_TURN.items()):
            with chat.rendering(tok, _Options({}, training="off")):
                with pytest.raises(chat.Unsplittable, match="no training template applies"):
                    chat.assistant_mask(tok, msgs, k, tools=tools)
            ids, mask = chat.assistant_mask(tok, msgs, k, tools=tools)
            text = tok.decode(ids, skip_special_tokens=False)
            assert _without_dropped_reasoning(text, msgs) == _render(tok, msgs, tools), name
            answers = _answers(tok, ids, mask)
            assert len(answers) == sum(m["role"] == "assistant" for m in msgs), name
            assert all(a.startswith("<think>\n") and a.endswith("<|im_end|>") for a in answers)
    assert tally.template == "qwen3" and tally.template_rows == [0, 1, 2]
    assert answers[0].startswith('<think>\n\n</think>\n\n<tool_call>\n{"name": "get_time"')


def test_a_stock_variant_the_training_template_does_not_reproduce_gets_none():
    tok = _qwen3()
    tok.chat_template = QWEN3_STOCK.replace("# Tools", "## Tools")
    found, why = templates.for_tokenizer(tok)
    assert found is None and "memlab's qwen3 template renders a conversation with a tool " \
                             "call differently" in why
    with pytest.raises(chat.Unsplittable, match="no training template applies: memlab's qwen3"):
        chat.assistant_mask(tok, MULTI_TURN["two turns"][0], 3)


# ----------------------------------------------------------------------------------- Mistral


@pytest.fixture(scope="module")
def mistral_v3(tmp_path_factory):
    """Mistral's v3 tokenizer file from the mistral-common wheel (no network), its reference
    encoder, and the stock template: memlab's training template without its markers."""
    mc = pytest.importorskip("mistral_common")
    pytest.importorskip("sentencepiece", reason="transformers reads the v3 SentencePiece model")
    import shutil
    from pathlib import Path

    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from transformers import LlamaTokenizer

    source = Path(mc.__file__).parent / "data" / "mistral_instruct_tokenizer_240323.model.v3"
    if not source.is_file():
        pytest.skip(f"mistral-common {mc.__version__} ships no v3 tokenizer")
    path = tmp_path_factory.mktemp("v3")
    shutil.copy(source, path / "tokenizer.model")
    tok = LlamaTokenizer.from_pretrained(path, legacy=False)
    text = templates.CANDIDATES[1].load().text
    tok.chat_template = re.sub(r"\{%-? ?(end)?generation ?-?%\}", "", text)
    return tok, MistralTokenizer.from_file(str(source))


ASK, ASK2 = {"role": "user", "content": "How are you"}, {"role": "user", "content": "Why so"}
MISTRAL_ROWS = [  # words only: HF's and Mistral's SentencePiece differ on digits and symbols
    [SYSTEM, ASK, {"role": "assistant", "content": "Fine thanks"}],
    [SYSTEM, ASK, {"role": "assistant", "content": "Fine"}, ASK2,
     {"role": "assistant", "content": "Sunny day"}],
    [ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "abcDEF123", "content": '"noon"'},
     {"role": "assistant", "content": "It is noon"}],
]


def test_mistral_stock_text_is_mistrals_own_encoding(mistral_v3):
    tok, reference = mistral_v3
    from mistral_common.protocol.instruct.messages import (
        AssistantMessage,
        SystemMessage,
        ToolMessage,
        UserMessage,
    )
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall

    def message(m):
        if m.get("tool_calls"):
            return AssistantMessage(tool_calls=[ToolCall(id=c["id"], function=FunctionCall(
                name=c["function"]["name"], arguments=c["function"]["arguments"]))
                for c in m["tool_calls"]])
        kind = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
        if m["role"] == "tool":
            return ToolMessage(tool_call_id=m["tool_call_id"], content=m["content"].strip('"'))
        return kind[m["role"]](content=m["content"])

    tools = [Tool(function=Function(**TOOLS[0]["function"]))]
    for msgs in MISTRAL_ROWS:  # Mistral encodes requests: conversations that end with a user
        request = [*msgs, {"role": "user", "content": "Thanks"}]
        want = reference.encode_chat_completion(ChatCompletionRequest(
            messages=[message(m) for m in request], tools=tools)).tokens
        got = tok.apply_chat_template(request, tools=TOOLS, tokenize=True,
                                      return_dict=True)["input_ids"]
        assert list(got) == want


def test_mistral_rows_with_a_system_prompt_train_with_the_same_text(mistral_v3):
    tok, _ = mistral_v3
    with pytest.raises(chat.Unsplittable, match="differently once later messages follow"):
        with chat.rendering(tok, _Options({}, training="off")):
            chat.assistant_mask(tok, MISTRAL_ROWS[0], 0)
    texts = []
    with chat.rendering(tok) as tally:
        for i, msgs in enumerate(MISTRAL_ROWS):
            tools = TOOLS if i == 2 else None
            ids, mask = chat.assistant_mask(tok, msgs, i, tools=tools)
            assert ids == list(tok.apply_chat_template(msgs, tools=tools, tokenize=True,
                                                       return_dict=True)["input_ids"])
            answers = _answers(tok, ids, mask)
            assert len(answers) == sum(m["role"] == "assistant" for m in msgs)
            assert all(a.endswith("</s>") for a in answers)
            texts.append(tok.decode(ids))
    assert tally.template == "mistral-v3" and tally.template_rows == [0, 1]  # 2 splits as is
    assert "Answer briefly" not in texts[0]  # Mistral's own text of a finished conversation


# ----------------------------------------------------------------------------------- policy


class _Options:
    def __init__(self, kwargs, training="auto", skip="error"):
        self.chat_template_kwargs = kwargs
        self.training_template = training
        self.on_unsplittable = skip


def test_unsplittable_rows_are_refused_by_default_and_skipped_and_counted_on_request():
    tok = load_tokenizer()
    tok.chat_template = (  # the system prompt before the LAST user turn: never splittable
        "{%- for m in messages -%}{%- if m.role == 'user' and loop.last -%}"
        "{{- '<|im_start|>user\\n[sys]' + m.content + '<|im_end|>\\n' -}}{%- else -%}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
        "{%- endif -%}")
    msgs = [U1, A_PLAIN]
    with pytest.raises(DataError, match="row 4: .*cannot be split.*no training template "
                                        "applies: memlab ships training templates for Qwen3"):
        chat.assistant_mask(tok, msgs, 4)
    with chat.rendering(tok, _Options({}, skip="skip")) as tally:
        for row in (4, 9):
            with pytest.raises(chat.SkippedRow):
                chat.assistant_mask(tok, msgs, row)
    assert tally.skipped_rows == [4, 9] and "differently once later messages" in \
        tally.skip_reason
    assert tally.as_dict(lambda r: f"line {r + 1}")["unsplittable"] == {
        "skipped": 2, "first": ["line 5", "line 10"], "reason": tally.skip_reason}


@pytest.mark.pipeline
def test_skipped_and_templated_rows_in_a_run_summary(job, tmp_path):
    """A run on Qwen3-style data: multi-turn rows train through the training template, a row
    the template cannot render alone... is skipped (on_unsplittable=skip), and the summary says
    both."""
    import json

    tok = _qwen3()
    tok.save_pretrained(tmp_path / "tok")
    rows = [{"messages": msgs, "tools": tools} for msgs, tools in MULTI_TURN.values()]
    rows += [{"messages": msgs, "tools": tools} for msgs, tools in ONE_TURN.values()] * 2
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = job([f"model.tokenizer={tmp_path / 'tok'}", "data=local", f"data.path={path}",
             "method.max_length=null", "train.steps=1"])
    assert s["status"] == "ok", s["error"]
    assert s["data"]["chat_template"] == {"training_template": "qwen3", "rows": 3}
    s = job([f"model.tokenizer={tmp_path / 'tok'}", "data=local", f"data.path={path}",
             "method.max_length=null", "train.steps=1", "data.training_template=off",
             "data.on_unsplittable=skip"])
    assert s["status"] == "ok", s["error"]
    assert s["data"]["unsplittable"]["skipped"] == 3 and s["data"]["examples"] == 8
    assert s["data"]["unsplittable"]["first"][0] == f"{path} line 1"


def test_real_stock_templates_from_the_local_cache():
    """Where the local Hugging Face cache holds a stock Qwen3 / Mistral v0.3 tokenizer (no
    download here), memlab's training template stands in for it."""
    from huggingface_hub import try_to_load_from_cache

    found = {}
    for repo in ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B", "mistralai/Mistral-7B-Instruct-v0.3"):
        path = try_to_load_from_cache(repo, "tokenizer_config.json")
        if isinstance(path, str):
            found[repo] = path
    if not found:
        pytest.skip("no stock Qwen3 / Mistral v0.3 tokenizer in the local Hugging Face cache")
    from transformers import AutoTokenizer

    for repo, path in found.items():
        from pathlib import Path

        tok = AutoTokenizer.from_pretrained(Path(path).parent)
        template, why = templates.for_tokenizer(tok)
        assert template is not None, (repo, why)


def test_mistral_tekken_variant_is_recognised_by_its_spacing():
    tok = load_tokenizer()
    tok.add_tokens(["[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                    "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"], special_tokens=True)
    text = templates.CANDIDATES[2].load().text
    tok.chat_template = re.sub(r"\{%-? ?(end)?generation ?-?%\}", "", text)
    found, why = templates.for_tokenizer(tok)
    assert found is not None and found.name == "mistral-tekken", why
    msgs = [SYSTEM, ASK, {"role": "assistant", "content": " Fine "}, ASK2,
            {"role": "assistant", "content": "Sunny day"}]
    with chat.rendering(tok) as tally:
        ids, mask = chat.assistant_mask(tok, msgs, 0)
    assert tally.template_rows == [0]
    assert _answers(tok, ids, mask) == [" Fine <|im_end|>", "Sunny day<|im_end|>"]
    assert tok.decode(ids) == "<|bos|>[INST]How are you[/INST] Fine <|im_end|>[INST]Why so[/INST]" \
                              "Sunny day<|im_end|>"


# Llama 3.1 style with tools: the date in the system header, "Environment: ipython", the tool
# list in the first user turn, JSON tool calls, results in an ipython turn
LLAMA31_TOOLS = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- if messages[0].role == 'system' -%}{%- set sys = messages[0].content -%}"
    "{%- set messages = messages[1:] -%}{%- else -%}{%- set sys = '' -%}{%- endif -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' -}}"
    "{%- if tools -%}{{- 'Environment: ipython\\n' -}}{%- endif -%}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' + sys + "
    "'<|eot_id|>' -}}"
    "{%- for m in messages -%}"
    "{%- if tools and loop.first and m.role == 'user' -%}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nFunctions:\\n' -}}"
    "{%- for t in tools -%}{{- t | tojson + '\\n\\n' -}}{%- endfor -%}"
    "{{- m.content | trim + '<|eot_id|>' -}}"
    "{%- elif m.tool_calls -%}{%- set f = m.tool_calls[0].function -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + f.name + "
    "'\", \"parameters\": ' + f.arguments | tojson + '}<|eot_id|>' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' -}}"
    "{%- else -%}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + "
    "m.content | trim + '<|eot_id|>' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)


def test_the_shipped_config_families_split_tool_trajectories_with_their_own_template():
    """Llama 3.1 (and Qwen2.5: tests/unit/data/test_formats.py) need no training template,
    tool calls included: every assistant turn, call or answer, is trained, nothing else."""
    tok = load_tokenizer()
    tok.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|eot_id|>"], special_tokens=True)
    tok.chat_template = LLAMA31_TOOLS
    msgs = [SYSTEM, U1, *TOOL_TURN, {"role": "assistant", "content": "Noon."}, U2, A_PLAIN]
    with chat.rendering(tok) as tally:
        ids, mask = chat.assistant_mask(tok, msgs, 0, tools=TOOLS)
    assert tally.template_rows == []
    assert _answers(tok, ids, mask) == [
        '{"name": "get_time", "parameters": {"zone": "UTC"}}<|eot_id|>', "Noon.<|eot_id|>",
        "6<|eot_id|>"]


def test_preference_rows_no_template_splits_are_skipped_by_the_methods(mistral_v3, tmp_path):
    """Mistral renders a system prompt only when a user message ends the conversation, so a
    conversational prompt with one renders differently alone than followed by its completion:
    DPO refuses such a pair by default and, with on_unsplittable=skip, leaves it out."""
    import dataclasses
    import json

    from omegaconf import OmegaConf

    from memlab.context import validate
    from memlab.data.local import Local
    from memlab.pipeline import prepare_rows
    from memlab_testing import compose, with_fast

    tok, _ = mistral_v3
    rows = [{"prompt": [ASK], "chosen": [{"role": "assistant", "content": "Fine"}],
             "rejected": [{"role": "assistant", "content": "Bad"}]}] * 2
    rows.insert(1, {**rows[0], "prompt": [SYSTEM, ASK]})
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose(with_fast(["method=dpo", "data=local", f"data.path={path}"]))
    cfg = OmegaConf.to_container(cfg)
    del cfg["hydra"]
    ctx = validate(OmegaConf.create(cfg))
    with pytest.raises(DataError, match=rf"{path} line 2: row 1: the chat template renders "
                                        "'prompt' differently alone"):
        prepare_rows(ctx, tok)
    ctx = dataclasses.replace(ctx, data=Local(path=str(path), on_unsplittable="skip"))
    _, ds, stats, _ = prepare_rows(ctx, tok)
    assert len(ds) == 2 and stats.extra["unsplittable"]["skipped"] == 1
    assert stats.extra["unsplittable"]["first"] == [f"{path} line 2"]
