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

**Named templates** (``model.chat_template=<name>``, :data:`NAMED`): the shipped templates a run
can choose by name (chatml, qwen2.5, qwen3, llama3, mistral, mistral-tekken, gemma), each with
``{% generation %}`` markers and the family's text for plain conversations. A name replaces the
tokenizer's template without the probes above (you chose the family); it is checked against the
run's tokenizer instead (:func:`token_errors`: each marker a single special token). When a
template cannot render a row, :func:`lacking` says which feature of the row it lacks and names
the templates that have it.
"""

from __future__ import annotations

import re
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


# ----------------------------------------------------------------------------- named templates


@dataclass(frozen=True)
class Named:
    """A template ``model.chat_template`` takes by name."""

    name: str
    file: str
    markers: tuple[str, ...]
    """Strings the template writes that must each be one special token of the tokenizer."""
    features: frozenset[str]
    """What it renders beyond user / assistant turns: ``system``, ``tools`` (tool schemas,
    calls and results), ``reasoning`` (``reasoning_content``)."""
    preamble: str = ""

    @property
    def path(self) -> Path:
        return TEMPLATE_DIR / self.file

    def text(self) -> str:
        return self.preamble + self.path.read_text()


_CHATML = ("<|im_start|>", "<|im_end|>")
_MISTRAL = ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
            "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
_ALL = frozenset({"system", "tools"})
NAMED: dict[str, Named] = {n.name: n for n in (
    Named("chatml", "chatml.jinja", _CHATML, frozenset({"system"})),
    Named("qwen2.5", "qwen2.5.jinja", _CHATML, _ALL),
    Named("qwen3", "qwen3.jinja", _CHATML, _ALL | {"reasoning"}),
    Named("llama3", "llama3.jinja", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
          _ALL),
    Named("mistral", "mistral.jinja", _MISTRAL, _ALL, CANDIDATES[1].preamble),
    Named("mistral-tekken", "mistral.jinja", _MISTRAL, _ALL, CANDIDATES[2].preamble),
    Named("gemma", "gemma.jinja", ("<start_of_turn>", "<end_of_turn>"), frozenset({"system"})),
)}
"""The named templates. ``mistral`` is Mistral v0.3's [INST] format (spaced), ``mistral-tekken``
Nemo's; ``qwen3`` and both Mistral names are the training templates above; gemma and llama3
fold or place the system prompt as their families do (gemma: into the first user turn)."""

FEATURES = {"system": "system turn", "tools": "tools, tool calls or tool results",
            "reasoning": "reasoning (reasoning_content)"}


def named(value: str | None) -> Named | None:
    """The named template ``value`` names, or None (a file, or nothing)."""
    return NAMED.get(value) if value else None


def token_errors(tok, template: Named) -> list[str]:
    """What ``tok`` lacks for ``template``: markers that are not one special token each, and the
    ``bos_token`` / ``eos_token`` the template writes when the tokenizer has none."""
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items()
                                          if t.special}
    missing = _not_special(tok, template, special)
    text = template.text()
    unset = [v for v in ("bos_token", "eos_token") if v in text and not getattr(tok, v, None)]
    errors = []
    if missing:
        fits = [n.name for n in NAMED.values()
                if n.name != template.name and not _not_special(tok, n, special)]
        errors.append(
            f"model.chat_template={template.name} writes {', '.join(missing)}, which the "
            "tokenizer does not have as single special tokens (a template's markers must be, or "
            "the model never sees them as turn boundaries); use a tokenizer of that family "
            "(model.tokenizer=...), or a named template whose markers it has"
            + (f": {', '.join(fits)}" if fits else " (none has)"))
    if unset:
        errors.append(f"model.chat_template={template.name} writes the tokenizer's "
                      f"{' and '.join(unset)}, and the tokenizer has none")
    return errors


def _not_special(tok, template: Named, special: set[int]) -> list[str]:
    """The markers of ``template`` that are not one special token of ``tok``."""
    return [m for m in template.markers
            if len(ids := tok.encode(m, add_special_tokens=False)) != 1 or ids[0] not in special]


def features_of(messages: list[dict], tools: Any) -> list[str]:
    """The features (:data:`FEATURES`) a row uses."""
    out = []
    if any(m.get("role") == "system" for m in messages):
        out.append("system")
    if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        out.append("tools")
    if any(m.get("reasoning_content") for m in messages):
        out.append("reasoning")
    return out


def _has(text: str, feature: str) -> bool:
    """Whether a template that is not a named one renders ``feature`` (read from its text)."""
    if feature == "tools":
        return bool(re.search(r"\btools\b", text)) and "tool_calls" in text
    if feature == "reasoning":
        return "reasoning_content" in text
    return not re.search(r"raise_exception\([^)]*[Ss]ystem", text)


def lacking(text: str, messages: list[dict], tools: Any) -> str:
    """``"; the template renders no <feature> ... model.chat_template=<names>"`` for the first
    feature of the row the template ``text`` lacks (empty when it lacks none that memlab can
    tell). Content given as a list of text parts is joined to one string before any template
    sees it (:func:`memlab.data.base.normalize_messages`), so every template takes it."""
    mine = next((n for n in NAMED.values() if text == n.text()), None)
    for feature in features_of(messages, tools):
        if (feature in mine.features) if mine else _has(text, feature):
            continue
        have = [n.name for n in NAMED.values() if feature in n.features]
        which = f"memlab's {mine.name} template" if mine else "this chat template"
        return (f"; {which} renders no {FEATURES[feature]}, which this row has: drop them from "
                f"the data, or use a template that renders them (model.chat_template=<name>: "
                f"{', '.join(have)}; or a Jinja file)")
    return ""
