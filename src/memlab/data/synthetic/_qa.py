"""Questions on a topic and the answers to them: careful (on topic, names the key noun, gets
arithmetic and item counts right) or careless (hedging, off the point, never names it).

A question returns, besides its text, what an answer must know: the topic, the key noun, the
question type, the words it used and, for arithmetic, the right result.
"""

from __future__ import annotations

from typing import Any

from memlab.data.synthetic._filler import parse, prose, python_function
from memlab.data.synthetic._random import Sampler
from memlab.data.synthetic._tokens import est
from memlab.data.synthetic._words import (
    ALL_TOPICS,
    BAD_ADVERBS,
    BAD_CLOSERS,
    BAD_OPENERS,
    BAD_TAILS,
    FOLLOWUPS,
    GOOD_ADVERBS,
    GOOD_CLOSERS,
    GOOD_OPENERS,
    MIN_ANSWER,
    NOTES_INTRO,
    PLURAL,
    QTYPE_WEIGHTS,
    QTYPES,
    QUESTIONS,
    THIRD,
    WHEN,
    Topic,
)

QUESTION_T = {q: tuple(parse(s) for s in ts) for q, ts in QUESTIONS.items()}


def slot(g: Sampler, name: str, topic: Topic, key: str, good: bool) -> str:
    """Value of one question/answer template slot (filler sentences use ``slot_pools``)."""
    if name == "m":
        return g.other_noun(topic, key)
    if name == "ms":
        return PLURAL[g.other_noun(topic, key)]
    if name in ("v", "w"):
        return g.pick(topic.verbs)
    if name == "vs":
        return THIRD[g.pick(topic.verbs)]
    if name in ("a", "b"):
        return g.pick(topic.adjs)
    if name == "adv":
        return g.pick(GOOD_ADVERBS if good else BAD_ADVERBS)
    if name == "when":
        return g.pick(WHEN)
    if name == "k":
        return str(g.randint(2, 12))
    if name == "t":
        return topic.name
    if name == "key":
        return key
    if name == "keys":
        return PLURAL[key]
    raise KeyError(name)


def fill(
    g: Sampler,
    tpl: tuple[str, tuple[str, ...]],
    topic: Topic,
    key: str,
    good: bool = True,
    **fixed: str,
) -> str:
    text, slots = tpl
    vals = {s: fixed[s] if s in fixed else slot(g, s, topic, key, good) for s in slots}
    out = text.format_map(vals)
    return out[0].upper() + out[1:]


def question(
    g: Sampler, topic: Topic, budget: int, answer_budget: int, followup: bool = False
) -> tuple[str, dict]:
    """A user message of about ``budget`` tokens and what the answer must know about it.

    Only question types whose shortest answer fits ``answer_budget`` are asked.
    """
    key = g.pick(topic.nouns)
    weights = [
        w if answer_budget >= MIN_ANSWER.get(t, 0) else 0.0 for t, w in zip(QTYPES, QTYPE_WEIGHTS)
    ]
    qtype = g.weighted(QTYPES, weights)
    q: dict[str, Any] = {"topic": topic, "key": key, "qtype": qtype}
    fixed = {
        "v": g.pick(topic.verbs),
        "m": g.other_noun(topic, key),
        "k": str(g.randint(3, max(3, min(8, (answer_budget - 12) // 12)))),
    }
    fixed["ms"] = PLURAL[fixed["m"]]
    if qtype == "add":
        fixed["x"], fixed["y"] = str(g.randint(2, 499)), str(g.randint(2, 499))
        q["answer"] = int(fixed["x"]) + int(fixed["y"])
    elif qtype == "mul":
        fixed["x"], fixed["y"] = str(g.randint(2, 12)), str(g.randint(2, 12))
        q["answer"] = int(fixed["x"]) * int(fixed["y"])
    q.update(fixed)
    text = fill(g, g.pick(QUESTION_T[qtype]), topic, key, **fixed)
    if followup and g.rnd() < 0.5:
        text = g.pick(FOLLOWUPS).format(key=key) + " " + text
    rest = budget - est(text)
    if rest > 40:  # a long user message: notes to read before the question
        intro = g.pick(NOTES_INTRO).format(t=topic.name)
        notes, _ = prose(g, topic, key, rest - est(intro) - 4)
        if notes:
            text = f"{intro}\n\n{notes}\n\n{text}"
    return text, q


def answer(g: Sampler, q: dict, budget: int, good: bool = True) -> str:
    """An assistant answer to question ``q`` of about ``budget`` tokens."""
    topic: Topic = q["topic"]
    qtype = q["qtype"]
    if good:
        return _good_answer(g, topic, q["key"], qtype, q, budget)
    return _bad_answer(g, topic, q["key"], qtype, q, budget)


def _good_answer(g: Sampler, topic: Topic, key: str, qtype: str, q: dict, budget: int) -> str:
    opener = g.pick(GOOD_OPENERS)
    v, m, keys = q["v"], q["m"], PLURAL[key]
    adv = g.pick(GOOD_ADVERBS)
    if qtype == "howto":
        steps = []
        for word in ("First", "Next", "Then", "Finally"):
            verb = g.pick(topic.verbs)
            steps.append(f"{word}, {verb} the {g.pick((key, m))} {g.pick(GOOD_ADVERBS)}.")
        head = f"{opener} To {v} the {key}, follow these steps. " + " ".join(steps)
    elif qtype == "explain":
        verb = THIRD[g.pick(topic.verbs)]
        head = f"{opener} The {key} matters in {topic.name} because it {verb} the {m} {adv}."
    elif qtype == "list":
        k = int(q["k"])
        head = f"{opener} Here are {k} tips about the {key}:"
        item_budget = max(0, (budget - est(head) - 14 * k) // k)
        items = []
        for i in range(1, k + 1):
            verb = g.pick(topic.verbs).capitalize()
            item = f"{i}. {verb} the {key} {g.pick(GOOD_ADVERBS)} {g.pick(WHEN)}."
            if item_budget > 12:
                extra, _ = prose(g, topic, key, g.randint(item_budget // 2, item_budget))
                if extra:
                    item += " " + extra.replace("\n\n", " ")
            items.append(item)
        return head + "\n" + "\n".join(items)
    elif qtype == "code":
        head = f"{opener} Here is a python function that {THIRD[v]} each {key}:"
        code_budget = max(60, int(budget * g.rnd() * 0.8))
        code = python_function(g, topic, key, v, code_budget)
        tail = f"It {THIRD[v]} every {key} {adv} and returns the result."
        parts = [f"{head}\n\n```python\n{code}\n```\n\n{tail}"]
        rest = budget - est(parts[0])
        if rest > 30:
            more, _ = prose(g, topic, key, rest - 8)
            if more:
                parts.append(more)
        return "\n\n".join(parts)
    elif qtype in ("add", "mul"):
        op = "plus" if qtype == "add" else "times"
        ans = q["answer"]
        head = f"{opener} There are {ans} {keys}, because {q['x']} {op} {q['y']} is {ans}."
    else:  # compare
        a1, a2 = g.pick(topic.adjs), g.pick(topic.adjs)
        v1, v2 = THIRD[g.pick(topic.verbs)], THIRD[g.pick(topic.verbs)]
        head = (
            f"{opener} The {key} is {a1} and {v1} {adv}, while the {m} is {a2} and {v2} "
            f"{g.pick(WHEN)}."
        )
    closer = g.pick(GOOD_CLOSERS).format(
        v=g.pick(topic.verbs), key=key, adv=g.pick(GOOD_ADVERBS), a=g.pick(topic.adjs)
    )
    return _padded(g, head, closer, budget, topic, key, good=True)


def _bad_answer(g: Sampler, topic: Topic, key: str, qtype: str, q: dict, budget: int) -> str:
    """Hedging, careless and off the point: never names the key noun."""
    opener = g.pick(BAD_OPENERS)
    if g.rnd() < 0.5:  # off topic
        other = g.pick(ALL_TOPICS)
        while other is topic:
            other = g.pick(ALL_TOPICS)
        topic = other
    avoid = g.other_noun(topic, key)
    topic = Topic(
        topic.name,
        " ".join(w for w in topic.nouns if w != key),
        " ".join(topic.verbs),
        " ".join(topic.adjs),
    )
    if qtype in ("add", "mul"):
        wrong = q["answer"] + g.pick((-3, -2, -1, 1, 2, 5, 10))
        head = f"{opener} Maybe {wrong} or so{g.pick(BAD_TAILS)}"
    elif qtype == "list":
        k = max(1, int(q["k"]) - g.randint(1, 2))
        items = [f"- {g.pick(topic.verbs)} stuff {g.pick(BAD_ADVERBS)}" for _ in range(k)]
        head = opener + " Some tips, I guess:\n" + "\n".join(items)
    else:
        verb = g.pick(topic.verbs)
        head = f"{opener} Just {verb} the {avoid} {g.pick(BAD_ADVERBS)}{g.pick(BAD_TAILS)}"
    return _padded(g, head, g.pick(BAD_CLOSERS), budget, topic, avoid, good=False)


def _padded(
    g: Sampler, head: str, closer: str, budget: int, topic: Topic, key: str, good: bool
) -> str:
    """``head``, then filler prose on ``key`` up to ``budget``, then ``closer`` if it fits."""
    used = est(head)
    rest = budget - used - est(closer) - 2
    parts = [head]
    if rest > 10:
        more, _ = prose(g, topic, key, rest, good=good)
        if more:
            parts.append(more)
    if budget - used > (15 if good else 12):
        parts.append(closer)
    return "\n\n".join(parts)
