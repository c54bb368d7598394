"""Exact assistant / completion masks on any chat template (memlab.data.chat).

Templates written for these tests in the styles of the stock ones (ChatML / Qwen2.5, Llama 3.x,
Mistral, Gemma, one that renders a system prompt and date into every turn) carry no
``{% generation %}`` markers; for each, on multi-turn conversations, the ids must equal the full
rendering and the masked tokens must decode to exactly each assistant answer and its
end-of-turn token. Templates that cannot be split exactly must fail naming the property.
"""

from __future__ import annotations

import pytest

from memlab.data import chat
from memlab.data.assets import load_tokenizer
from memlab.data.base import DataError
from memlab.data.synthetic import generate_chat

SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<s>", "</s>", "[INST]", "[/INST]", "<bos>", "<start_of_turn>", "<end_of_turn>"]

CHATML = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Qwen2.5: a default system prompt is injected when the conversation has none
QWEN = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}{%- if not (m['role'] == 'system' and loop.first) -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Llama 3.x: header ids, <|eot_id|>, a knowledge/today date in the system header, trimmed content
LLAMA3 = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- if not date_string is defined -%}{%- set date_string = '26 Jul 2024' -%}{%- endif -%}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set system_message = messages[0]['content'] | trim -%}"
    "{%- set messages = messages[1:] -%}"
    "{%- else -%}{%- set system_message = '' -%}{%- endif -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' -}}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' -}}"
    "{{- system_message + '<|eot_id|>' -}}"
    "{%- for m in messages -%}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim"
    " + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
# Mistral: [INST] tags, the system prompt folded into the first user turn, no generation prompt
MISTRAL = (
    "{{- '<s>' -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set system = none -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for m in loop_messages -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/...') -}}"
    "{%- endif -%}"
    "{%- if m['role'] == 'user' -%}"
    "{%- if loop.first and system is not none -%}"
    "{{- '[INST] ' + system + '\\n\\n' + m['content'] + '[/INST]' -}}"
    "{%- else -%}{{- '[INST] ' + m['content'] + '[/INST]' -}}{%- endif -%}"
    "{%- else -%}{{- ' ' + m['content'] + '</s>' -}}{%- endif -%}"
    "{%- endfor -%}"
)
# Gemma: start_of_turn / end_of_turn, the 'model' role, system folded into the first user turn
GEMMA = (
    "{{- '<bos>' -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for m in loop_messages -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') -}}"
    "{{- m['content'] | trim + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)
# A system prompt and a date rendered into every user turn (the same in every turn)
EVERY_TURN = (
    "{%- set ns = namespace(system='You are terse.') -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'system' -%}"
    "{%- set ns.system = m['content'] -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}"
    "{{- '<|im_start|>user\\n[2024-07-26] ' + ns.system + '\\n' + m['content'] + "
    "'<|im_end|>\\n' -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# template -> what one assistant turn must contribute to the mask
ANSWER = {
    "chatml": (CHATML, lambda c: c + "<|im_end|>"),
    "qwen2.5": (QWEN, lambda c: c + "<|im_end|>"),
    "llama3": (LLAMA3, lambda c: c.strip() + "<|eot_id|>"),
    "mistral": (MISTRAL, lambda c: " " + c + "</s>"),
    "gemma": (GEMMA, lambda c: c.strip() + "<end_of_turn>"),
    "every_turn": (EVERY_TURN, lambda c: c + "<|im_end|>"),
}

CONVERSATIONS = [
    [{"role": "system", "content": "Answer in one line."},
     {"role": "user", "content": "name a tempo"},
     {"role": "assistant", "content": "the tempo is steady"},
     {"role": "user", "content": "and a chord?"},
     {"role": "assistant", "content": "a minor chord, played softly"},
     {"role": "user", "content": "thanks"},
     {"role": "assistant", "content": "  you are welcome \n"}],
    [{"role": "user", "content": "how do I bake bread?"},
     {"role": "assistant", "content": "mix, knead, rest and bake.\n\n1. mix\n2. knead"},
     {"role": "user", "content": "how long?"},
     {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}],
]


def _tok(template: str | None = None):
    tok = load_tokenizer()
    tok.add_tokens(SPECIAL, special_tokens=True)
    tok.chat_template = template
    return tok


def _conversations(template_name: str) -> list[list[dict]]:
    convs = CONVERSATIONS + [r["messages"] for r in generate_chat(12, seed=5, median_tokens=80)]
    if template_name == "mistral":  # strict alternation, no empty answer
        convs = [c for c in convs if all(m["content"] for m in c)]
    return convs


def _runs(tok, ids: list[int], mask: list[int]) -> list[str]:
    """Each maximal run of masked tokens, decoded."""
    out, i = [], 0
    while i < len(mask):
        if not mask[i]:
            i += 1
            continue
        j = i
        while j < len(mask) and mask[j]:
            j += 1
        out.append(tok.decode(ids[i:j], skip_special_tokens=False))
        i = j
    return out


def _rendered_ids(tok, messages, generation_prompt=False) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        add_generation_prompt=generation_prompt)["input_ids"])


@pytest.mark.parametrize("name", sorted(ANSWER))
def test_masks_cover_exactly_each_answer_and_its_end_of_turn_token(name):
    template, answer = ANSWER[name]
    tok = _tok(template)
    assert not chat.template_info(tok).markers
    for i, msgs in enumerate(_conversations(name)):
        ids, mask = chat.assistant_mask(tok, msgs, i)
        assert ids == _rendered_ids(tok, msgs)
        want = [answer(m["content"]) for m in msgs if m["role"] == "assistant"]
        assert _runs(tok, ids, mask) == want, (name, i)


@pytest.mark.parametrize("name", sorted(ANSWER))
def test_offsets_and_prefix_ids_find_the_same_turn_boundaries(name):
    """The one-tokenization path (character offsets) and the path that tokenizes every prefix
    rendering agree, boundary by boundary."""
    template, _ = ANSWER[name]
    tok = _tok(template)
    for i, msgs in enumerate(_conversations(name)):
        turns = chat._Turns(tok, chat.template_info(tok), msgs, i, "messages", chat.SFT_FIX)
        full_text = tok.apply_chat_template(msgs, tokenize=False)
        ks = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
        bounds = [(tok.apply_chat_template(msgs[:k], tokenize=False, add_generation_prompt=True),
                   tok.apply_chat_template(msgs[: k + 1], tokenize=False)) for k in ks]
        fast = chat._token_cuts(tok, full_text, [len(t) for pair in bounds for t in pair])
        assert fast is not None
        assert fast == turns._cuts_by_prefix_ids(full_text, bounds, ks)


def test_generation_markers_are_used_and_agree_with_the_turns_method():
    marked = load_tokenizer()  # the shipped ChatML template has {% generation %} markers
    plain = load_tokenizer()
    plain.chat_template = (marked.chat_template.replace("{%- generation -%}", "")
                           .replace("{%- endgeneration -%}", ""))
    assert chat.template_info(marked).markers and not chat.template_info(plain).markers
    for i, msgs in enumerate(_conversations("chatml")):
        assert chat.assistant_mask(marked, msgs, i) == chat.assistant_mask(plain, msgs, i)


def test_a_changed_template_is_reanalysed():
    tok = _tok(CHATML)
    assert not chat.template_info(tok).markers
    tok.chat_template = load_tokenizer().chat_template
    assert chat.template_info(tok).markers


# ------------------------------------------------------------------------------ clear failures


def _fails(template: str, messages: list[dict], *needles: str) -> str:
    tok = _tok(template)
    with pytest.raises(DataError) as e:
        chat.assistant_mask(tok, messages, 7)
    msg = str(e.value)
    for needle in ("row 7", "method.loss_on=all", "model.chat_template", *needles):
        assert needle in msg, msg
    return msg


def test_system_prompt_in_the_last_user_turn_fails_naming_the_property():
    # Mistral v0.3 style: the system prompt goes before the *last* user message
    last = MISTRAL.replace("loop.first and system is not none",
                           "loop.last and system is not none")
    _fails(last, CONVERSATIONS[0], "differently once later messages follow", "system prompt")


def test_turn_count_dependent_date_fails():
    counted = CHATML.replace("{%- for m in messages -%}",
                             "{{- 'turns: ' + (messages | length | string) + '\\n' -}}"
                             "{%- for m in messages -%}")
    _fails(counted, CONVERSATIONS[1], "first 1 message differently once later messages follow",
           "one rendering has '1", "the other '2")


def test_reasoning_dropped_from_earlier_turns_fails():
    # Qwen3 style: the <think> block is kept only in assistant turns after the last user turn
    qwen3 = (
        "{%- set ns = namespace(last_user=0) -%}"
        "{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
        "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
        "{%- for m in messages -%}"
        "{%- set c = m['content'] -%}"
        "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user -%}"
        "{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    msgs = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "<think>\nagain\n</think>\n\n6"}]
    _fails(qwen3, msgs, "reasoning dropped", "<think>")


def test_generation_prompt_unlike_the_turn_header_fails():
    odd = CHATML.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant:\\n'")
    _fails(odd, CONVERSATIONS[2], "generation prompt is not how it begins assistant turn 1")


def test_tokens_merged_across_the_turn_boundary_fail():
    # the generation prompt ends in a space that byte-level BPE merges into the answer's first
    # word: no token boundary where the answer starts
    text = (
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'user' -%}{{- 'User: ' + m['content'] + '\\n' -}}"
        "{%- else -%}{{- 'Assistant: ' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}{%- endif -%}"
    )
    _fails(text, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
           "merges tokens across the boundary of assistant turn 1")


def test_no_template_and_no_assistant_turn_are_clear():
    with pytest.raises(DataError, match="no chat template.*model.chat_template"):
        chat.assistant_mask(_tok(None), CONVERSATIONS[2], 0)
    with pytest.raises(DataError, match="row 3: field 'messages' has no assistant turn"):
        chat.assistant_mask(_tok(CHATML), [{"role": "user", "content": "hi"}], 3)
    with pytest.raises(DataError, match="starts with an assistant turn"):
        chat.assistant_mask(_tok(CHATML), [{"role": "assistant", "content": "hi"}], 0)


# ------------------------------------------------------------------------------ prompt / completion


@pytest.mark.parametrize("name", sorted(ANSWER))
def test_completion_is_what_the_answer_adds_after_the_generation_prompt(name):
    template, answer = ANSWER[name]
    tok = _tok(template)
    msgs = CONVERSATIONS[0] if name != "mistral" else CONVERSATIONS[0][:5]
    prompt, completion = msgs[:-1], msgs[-1:]
    p = chat.prompt_ids(tok, prompt, 0)
    c = chat.completion_ids(tok, prompt, p, completion, 0, "chosen")
    assert p == _rendered_ids(tok, prompt, generation_prompt=True)
    assert p + c == _rendered_ids(tok, msgs)
    assert tok.decode(c, skip_special_tokens=False).startswith(answer(completion[0]["content"]))


# ------------------------------------------------------------------------------ real tokenizer


# Mistral's own formats, as mistral-common renders them: v3 (SentencePiece, spaces before each
# message) and v7 / Nemo's Tekken (byte-level BPE, no spaces)
MISTRAL_V3 = MISTRAL.replace("{%- if messages[0]['role'] == 'system' -%}", "{%- if false -%}")
TEKKEN = (
    "{{- '<s>' -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{- '[INST]' + m['content'] + '[/INST]' -}}"
    "{%- else -%}{{- m['content'] + '</s>' -}}{%- endif -%}"
    "{%- endfor -%}"
)
REAL = {  # file in mistral_common/data, template, what one answer contributes
    "v3": ("mistral_instruct_tokenizer_240323.model.v3", MISTRAL_V3, lambda c: " " + c + "</s>"),
    "tekken": ("tekken_240911.json", TEKKEN, lambda c: c + "</s>"),
}


@pytest.fixture(scope="module",
                params=["v3", pytest.param("tekken", marks=pytest.mark.slow)])  # Tekken: ~20 s
def real_mistral(request, tmp_path_factory):
    """A tokenizer file shipped inside the mistral-common wheel, loaded by transformers from a
    directory (no network), with its reference encoder from mistral-common."""
    mc = pytest.importorskip("mistral_common")
    import shutil
    from pathlib import Path

    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from transformers import AutoTokenizer, LlamaTokenizer

    name, template, answer = REAL[request.param]
    source = Path(mc.__file__).parent / "data" / name
    if not source.is_file():
        pytest.skip(f"mistral-common {mc.__version__} ships no {name}")
    if request.param == "v3":
        pytest.importorskip("sentencepiece", reason="transformers reads the v3 SentencePiece "
                            "model with it (in the dev extras)")
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "v3":
        shutil.copy(source, path / "tokenizer.model")
        tok = LlamaTokenizer.from_pretrained(path, legacy=False)
    else:
        shutil.copy(source, path / "tekken.json")
        tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = template
    return tok, MistralTokenizer.from_file(str(source)), answer, request.param


def test_real_mistral_tokenizers_match_mistral_common(real_mistral):
    tok, reference, answer, kind = real_mistral
    from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    kinds = {"user": UserMessage, "assistant": AssistantMessage}
    convs = [c for c in _conversations("mistral") if c[0]["role"] != "system"]
    assert len(convs) >= 8
    eos = tok.convert_tokens_to_ids("</s>")
    for i, msgs in enumerate(convs):
        ids, mask = chat.assistant_mask(tok, msgs, i)
        assert ids == _rendered_ids(tok, msgs)
        # mistral-common encodes a conversation ending in an answer only as a prefix of the next
        # request: compare the prompt + answers up to the last answer's </s>
        req = ChatCompletionRequest(messages=[kinds[m["role"]](content=m["content"])
                                              for m in msgs[:-1]])
        want = reference.encode_chat_completion(req).tokens
        assert ids[: len(want)] == want
        assert ids[-1] == eos
        if kind == "v3":
            got = [_sentencepiece_text(tok.convert_ids_to_tokens(ids[s:e]))
                   for s, e in _spans(mask)]
        else:
            got = _runs(tok, ids, mask)
        assert got == [answer(m["content"]) for m in msgs if m["role"] == "assistant"]


def _sentencepiece_text(pieces: list[str]) -> str:
    """SentencePiece pieces -> text, exactly: '\u2581' is a space, <0xNN> pieces are bytes."""
    import re

    raw = b"".join(bytes([int(p[3:5], 16)]) if re.fullmatch(r"<0x[0-9A-F]{2}>", p)
                   else p.replace("\u2581", " ").encode() for p in pieces)
    return raw.decode()


def _spans(mask):
    out, i = [], 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            out.append((i, j))
            i = j
        else:
            i += 1
    return out


# ------------------------------------------------------------------------------ SFT end to end


@pytest.mark.pipeline
def test_sft_trains_on_exactly_the_assistant_tokens_of_a_marker_free_template(tmp_path, job):
    """``model.tokenizer=<dir>`` whose template has no generation markers (Qwen-style, default
    system prompt): the default ``loss_on=completion`` run trains, and the tokens its data
    pipeline trains on are the assistant tokens (counted with the shipped template's
    generation markers, an independent rule)."""
    from memlab.context import validate
    from memlab.method.base import IGNORE
    from memlab.pipeline import prepare_data
    from memlab_testing import FAST, compose

    plain = load_tokenizer()
    plain.chat_template = QWEN
    plain.save_pretrained(tmp_path / "tok")
    overrides = [f"model.tokenizer={tmp_path / 'tok'}", "method.max_length=null"]
    s = job(overrides)
    assert s["status"] == "ok", s["error"]
    assert s["config"]["method"]["loss_on"] == "completion"

    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose(FAST + overrides))
    del cfg["hydra"]
    ctx = validate(OmegaConf.create(cfg))
    tok = ctx.model.load_tokenizer(ctx)
    assert tok.chat_template == QWEN
    ds, stats = prepare_data(ctx, tok)
    assert stats.tokens_in == s["data"]["tokens_in"]
    trained = sum(sum(t != IGNORE for t in labels) for labels in ds["labels"])
    marked = load_tokenizer()  # ChatML with markers: the same answers, found independently
    raw = ctx.data.load(ctx)
    expected = sum(sum(chat.assistant_mask(marked, m, i)[1])
                   for i, m in enumerate(raw["messages"]))
    assert trained == expected > 0
