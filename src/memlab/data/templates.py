"""memlab's training chat templates: which one stands in for a tokenizer's own template.

Some stock templates render a conversation so that no exact assistant mask can be cut from it
turn by turn (:mod:`memlab.data.chat`), and carry no ``{% generation %}`` markers. For their
families memlab ships a training template with markers (``memlab/assets/chat_templates``,
written for memlab):

* ``qwen3``: Qwen3's ChatML with ``<think>`` reasoning. Qwen3's own template drops the reasoning
  of assistant turns before the last user message (and leaves out an empty think block in a turn
  that is neither last nor has reasoning); the training template renders every assistant turn
  as Qwen3's renders the last one: ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}``, the
  think block present even when empty. Conversations with one assistant turn render exactly
  as with Qwen3's own template; in longer ones, the earlier turns keep their reasoning.
* ``mistral-v3`` / ``mistral-tekken``: Mistral's ``[INST]`` formats (v0.3; Nemo's Tekken). The
  text is exactly Mistral's (the system prompt and tool list go in front of the last user
  message, the system prompt only when that message ends the conversation); the markers make it
  splittable.

:func:`for_tokenizer` picks the candidate whose family signature the stock template has, then
checks it: on probe conversations the stock template renders whole (one user turn and one
answer: plain, with a system prompt, with reasoning, with a tool call and tools, and the
generation prompt), the candidate must render exactly the stock text, with the run's template
variables. A stock variant it does not reproduce (another Qwen3 or Mistral revision) gets no
training template, and the reason is reported.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "assets" / "chat_templates"


@dataclass(frozen=True)
class TrainingTemplate:
    """A training template: its name and Jinja text (with ``{% generation %}`` markers)."""

    name: str
    text: str


@dataclass(frozen=True)
class _Candidate:
    name: str
    file: str
    signature: tuple[str, ...]
    """Substrings the stock template must all contain."""
    preamble: str = ""

    def load(self) -> TrainingTemplate:
        return TrainingTemplate(self.name, self.preamble + (TEMPLATE_DIR / self.file).read_text())


CANDIDATES = (
    _Candidate("qwen3", "qwen3.jinja", ("<|im_start|>", "<think>", "reasoning_content")),
    _Candidate("mistral-v3", "mistral.jinja", ("[INST]", "[/INST]"),
               "{%- set memlab_spaced = true -%}\n"),
    _Candidate("mistral-tekken", "mistral.jinja", ("[INST]", "[/INST]"),
               "{%- set memlab_spaced = false -%}\n"),
)

_CALL = {"type": "function", "id": "call12345",
         "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}
_TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                   "required": ["zone"]}}}]
PROBES: tuple[tuple[str, list[dict], list | None, bool], ...] = (
    ("one answer", [{"role": "user", "content": "Hello there."},
                    {"role": "assistant", "content": "Hi! How can I help?"}], None, False),
    ("a system prompt", [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": "2 + 2?"},
                         {"role": "assistant", "content": "4"}], None, False),
    ("reasoning", [{"role": "user", "content": "2 + 2?"},
                   {"role": "assistant", "content": "4", "reasoning_content": "Add them."}],
     None, False),
    ("a tool call", [{"role": "user", "content": "What time is it?"},
                     {"role": "assistant", "content": None, "tool_calls": [_CALL]}],
     _TOOLS, False),
    ("the generation prompt", [{"role": "system", "content": "Answer briefly."},
                               {"role": "user", "content": "2 + 2?"}], None, True),
)
"""(what it shows, messages, tools, generation prompt): conversations a stock template renders
whole, where a training template must render the same text."""

_FOUND: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()


def for_tokenizer(tok, kwargs: dict[str, Any] | None = None
                  ) -> tuple[TrainingTemplate | None, str | None]:
    """``(template, None)``: memlab's training template that stands in for ``tok``'s chat
    template; ``(None, why)`` when none does (computed once per template and variables)."""
    stock = tok.chat_template
    if isinstance(stock, dict):
        stock = stock.get("default") or next(iter(stock.values()), None)
    kwargs = dict(kwargs or {})
    key = (stock, repr(sorted(kwargs.items())))
    cache = _FOUND.setdefault(tok, {})
    if key not in cache:
        cache[key] = _find(tok, stock or "", kwargs)
    return cache[key]


def _find(tok, stock: str, kwargs: dict[str, Any]) -> tuple[TrainingTemplate | None, str | None]:
    matching = [c for c in CANDIDATES if all(s in stock for s in c.signature)]
    if not matching:
        return None, ("memlab ships training templates for Qwen3 and Mistral's [INST] formats, "
                      "and this template is neither")
    reasons = []
    for candidate in matching:
        template = candidate.load()
        why = _differs(tok, stock, template.text, kwargs)
        if why is None:
            return template, None
        reasons.append(f"memlab's {candidate.name} template {why}")
    return None, "; ".join(reasons)


def _differs(tok, stock: str, text: str, kwargs: dict[str, Any]) -> str | None:
    """None when ``text`` renders every probe the stock renders exactly as the stock does."""
    rendered = 0
    for what, messages, tools, generation in PROBES:
        args = dict(tools=tools, tokenize=False, add_generation_prompt=generation, **kwargs)
        try:
            want = tok.apply_chat_template(messages, chat_template=stock, **args)
        except Exception:  # noqa: BLE001 - the stock template does not take this probe
            continue
        try:
            got = tok.apply_chat_template(messages, chat_template=text, **args)
        except Exception as e:  # noqa: BLE001 - templates raise their own exceptions
            return f"cannot render a conversation with {what} ({type(e).__name__}: {e})"
        if got != want:
            i = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                     min(len(got), len(want)))
            return (f"renders a conversation with {what} differently from this tokenizer's "
                    f"template (at {want[max(0, i - 20):i]!r}: {want[i:i + 30]!r} vs "
                    f"{got[i:i + 30]!r})")
        rendered += 1
    return None if rendered else "found no conversation this tokenizer's template renders"
