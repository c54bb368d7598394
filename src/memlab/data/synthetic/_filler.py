"""Filler text: paragraphs of templated sentences and small python functions on a topic.

Both fill a budget of estimated tokens; the careless style (``good=False``) swaps the adverbs
and ends every sentence with a hedge.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from string import Formatter

from memlab.data.synthetic._random import Sampler
from memlab.data.synthetic._tokens import est
from memlab.data.synthetic._words import (
    BAD_ADVERBS,
    BAD_TAILS,
    CODE_VARS,
    GOOD_ADVERBS,
    MINUTES,
    NUMBERS,
    PERCENT,
    PLURAL,
    SENTENCES,
    THIRD,
    WHEN,
    Topic,
)


def parse(template: str) -> tuple[str, tuple[str, ...]]:
    """``template`` with its slot names, each once, in order of appearance."""
    slots = tuple(dict.fromkeys(f for _, f, _, _ in Formatter().parse(template) if f))
    return template, slots


# Filler templates with their expected cost (a slot value is one token, a time phrase a few).
WHEN_COST = sum(est(" " + w) for w in WHEN) / len(WHEN)
SENTENCE_T = tuple(
    (
        text,
        slots,
        round(est(" " + re.sub(r"\{\w+\}", "x", text)) + (WHEN_COST - 1) * ("when" in slots)),
    )
    for text, slots in (parse(s) for s in SENTENCES)
)


def slot_pools(topic: Topic, key: str, good: bool) -> dict[str, Sequence[str]]:
    """Value pools of the filler slots for one topic and key noun (key-ish ``n`` ~40%)."""
    others = tuple(w for w in topic.nouns if w != key) or topic.nouns
    keyish = (key,) * (len(others) * 2 // 3) + others
    verbs = topic.verbs
    return {
        "n": keyish,
        "m": others,
        "ns": tuple(PLURAL[w] for w in keyish),
        "ms": tuple(PLURAL[w] for w in others),
        "v": verbs,
        "w": verbs,
        "vs": tuple(THIRD[v] for v in verbs),
        "a": topic.adjs,
        "b": topic.adjs,
        "adv": GOOD_ADVERBS if good else BAD_ADVERBS,
        "when": WHEN,
        "k": NUMBERS,
        "min": MINUTES,
        "pct": PERCENT,
        "t": (topic.name,),
    }


def prose(g: Sampler, topic: Topic, key: str, budget: int, good: bool = True) -> tuple[str, int]:
    """Paragraphs of filler sentences, at most ``budget`` tokens (possibly empty)."""
    rnd = g.rnd
    pools = slot_pools(topic, key, good)
    paras: list[str] = []
    cur: list[str] = []
    used = 0
    per_para = g.randint(3, 7)
    n_t = len(SENTENCE_T)
    while True:
        text, slots, cost = SENTENCE_T[int(rnd() * n_t)]
        if not good:
            cost += 3
        if used + cost + 1 > budget:
            break
        vals = {}
        for slot in slots:
            pool = pools[slot]
            vals[slot] = pool[int(rnd() * len(pool))]
        sent = text.format_map(vals)
        if not good:
            sent = sent[:-1] + BAD_TAILS[int(rnd() * len(BAD_TAILS))]
        cur.append(sent)
        used += cost
        if len(cur) >= per_para:
            paras.append(" ".join(cur))
            cur = []
            used += 1  # the paragraph break
            per_para = g.randint(3, 7)
    if cur:
        paras.append(" ".join(cur))
    return "\n\n".join(paras), used


def python_function(g: Sampler, topic: Topic, key: str, verb: str, budget: int) -> str:
    """A small python function over a list of ``key`` items, about ``budget`` tokens."""
    adv = g.pick(GOOD_ADVERBS)
    var = g.pick(CODE_VARS)
    attr = g.pick(topic.adjs)
    lines = [
        f"def {verb}_{PLURAL[key]}(items):",
        f'    """{THIRD[verb].capitalize()} each {key} {adv}."""',
        f"    {var} = 0",
        "    result = []",
        "    for item in items:",
    ]
    used = 40
    while True:
        kind = g.randint(0, 3)
        num = g.randint(1, 999)
        if kind == 0:
            body = [f"        if item.{attr}:", f"            {var} = {var} + {num}"]
        elif kind == 1:
            other = g.pick(topic.adjs)
            body = [f"        item.{other} = item.size * {num}"]
        elif kind == 2:
            body = [f"        if {var} > {num}:", f"            {var} = {var} - {num}"]
        else:
            body = [f"        result.append({g.pick(topic.verbs)}(item))"]
        cost = 9 * len(body)
        if used + cost + 8 > budget and len(lines) > 5:
            break
        lines.extend(body)
        used += cost
    lines.append(f"    return result, {var}")
    return "\n".join(lines)
