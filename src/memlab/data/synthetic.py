"""Deterministic synthetic chat, plain-text and preference data (no network, no global state).

Every generator draws from its own ``random.Random(seed)``: the same ``(n, seed, ...)`` always
gives the same rows, and the first ``k`` rows of ``n > k`` rows equal the rows of ``n = k``.

Two properties matter for memlab's measurements and tests:

* **Realistic lengths.** The total token length of a row (under the shipped tokenizer, chat
  template included) is lognormal: median ``median_tokens`` (a few hundred by default), a tail
  to several thousand (p99 about 13x the median with the default ``sigma``), capped at
  ``max_tokens``. Padding waste, packing gains and peak memory therefore look like they do on
  real chat data.
* **Learnable content.** Text comes from a small grammar over ~750 words in 20 topics: how-to
  steps, explanations, numbered lists, python snippets, arithmetic and comparisons. Answers echo
  the topic and the key noun of the question, so a tiny causal LM's loss falls within tens of
  steps, also with a completion-only loss. In preference pairs the chosen answer is always
  polite, on topic and names the key noun with a "careful" vocabulary (and correct arithmetic
  or item counts); the rejected one is hedging, careless and off the point. A tiny DPO or
  reward model picks this up within a few hundred steps.

Lengths are budgeted with a cheap word/punctuation count (``_est``) that tracks the shipped
byte-level BPE tokenizer (trained on this very text) to within a few percent.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from string import Formatter
from typing import Any

__all__ = ["TOPICS", "generate_chat", "generate_preference", "generate_text"]

Message = dict[str, str]

# ----------------------------------------------------------------------------------------------
# Vocabulary: topic -> (nouns, verbs, adjectives). Nouns take a regular plural, verbs a regular
# third person; every word is lower case.
# ----------------------------------------------------------------------------------------------
_TOPIC_TABLE = {
    "cooking": (
        "sauce onion pan oven recipe garlic butter dough ladle spice broth kettle",
        "chop stir bake roast season simmer",
        "crispy savory tender golden spicy fresh",
    ),
    "gardening": (
        "soil seed tomato shovel compost root petal hedge greenhouse tulip sprout fence",
        "plant water prune harvest trim dig",
        "leafy sunny moist shady thriving fertile",
    ),
    "astronomy": (
        "planet comet telescope galaxy orbit star nebula moon asteroid meteor eclipse satellite",
        "observe track measure survey photograph align",
        "distant bright faint lunar stellar cosmic",
    ),
    "networking": (
        "router packet socket server cable firewall gateway protocol port switch proxy modem",
        "relay forward configure ping encrypt monitor",
        "wireless secure local remote fast redundant",
    ),
    "databases": (
        "table index query schema column row cursor transaction replica shard cache backup",
        "insert update join migrate scan store",
        "relational indexed durable sparse primary stale",
    ),
    "music": (
        "guitar chord melody rhythm drum piano scale tempo violin lyric concert note",
        "play tune compose strum record practice",
        "loud soft minor major acoustic lively",
    ),
    "hiking": (
        "trail backpack boot summit map compass tent ridge canyon river campfire lantern",
        "climb pack cross explore navigate rest",
        "steep rocky muddy scenic alpine windy",
    ),
    "chemistry": (
        "molecule atom beaker acid solvent reaction crystal electron catalyst flask sample bond",
        "heat mix dilute titrate distill weigh",
        "acidic volatile stable organic toxic pure",
    ),
    "finance": (
        "budget loan stock bank invoice salary tax portfolio interest dividend account expense",
        "invest save borrow spend audit balance",
        "fiscal annual liquid risky modest net",
    ),
    "painting": (
        "canvas brush palette pigment easel mural landscape stroke varnish sketch gallery color",
        "paint blend shade draw layer dab",
        "vivid pale abstract glossy matte bold",
    ),
    "sailing": (
        "boat sail anchor mast harbor wind rope deck hull tide rudder buoy",
        "steer moor hoist tack dock bail",
        "calm stormy coastal nautical salty brisk",
    ),
    "robotics": (
        "robot sensor motor servo arm gripper battery camera controller lidar joint actuator",
        "calibrate program assemble test drive charge",
        "autonomous robust modular electric compact agile",
    ),
    "weather": (
        "cloud storm rain forecast breeze thunder humidity pressure snow fog drought rainbow",
        "predict report chart gauge warn estimate",
        "humid chilly cloudy tropical seasonal dry",
    ),
    "history": (
        "empire castle treaty king archive battle scroll dynasty village chronicle monument coin",
        "study date excavate restore translate catalog",
        "ancient medieval royal imperial forgotten rural",
    ),
    "chess": (
        "pawn knight bishop rook queen board opening endgame gambit square clock move",
        "attack defend capture sacrifice develop promote",
        "tactical positional passed doubled central quiet",
    ),
    "biology": (
        "cell gene protein enzyme tissue organism membrane virus organelle neuron fossil habitat",
        "classify culture sequence dissect stain grow",
        "cellular genetic microscopic marine wild dormant",
    ),
    "photography": (
        "shutter aperture tripod flash lens filter exposure pixel zoom shot album portrait",
        "focus frame crop edit snap print",
        "blurry sharp grainy panoramic candid overexposed",
    ),
    "cycling": (
        "bicycle pedal chain saddle helmet gear brake tire spoke handlebar route pump",
        "ride shift oil inflate coast race",
        "uphill downhill flat tubeless smooth bumpy",
    ),
    "pottery": (
        "clay kiln glaze vase bowl mug wheel slip teapot plate sponge mold",
        "knead throw coat fire carve polish",
        "earthen porcelain cracked rustic hollow speckled",
    ),
    "coffee": (
        "bean grinder espresso latte carafe crema milk cup brewer scoop mocha barista",
        "grind brew froth pour tamp steam",
        "bitter velvety creamy dark fruity roasted",
    ),
}


class _Topic:
    __slots__ = ("name", "nouns", "verbs", "adjs")

    def __init__(self, name: str, nouns: str, verbs: str, adjs: str):
        self.name = name
        self.nouns = tuple(nouns.split())
        self.verbs = tuple(verbs.split())
        self.adjs = tuple(adjs.split())


TOPICS: tuple[str, ...] = tuple(_TOPIC_TABLE)
"""Topic names of the synthetic corpus."""
_TOPICS = tuple(_Topic(name, *words) for name, words in _TOPIC_TABLE.items())


def _plural(word: str) -> str:
    if word == "tomato":
        return "tomatoes"
    if word.endswith(("s", "x", "ch", "sh", "z")):
        return word + "es"
    if word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + "s"


_PLURAL = {n: _plural(n) for t in _TOPICS for n in t.nouns}
_THIRD = {v: _plural(v) for t in _TOPICS for v in t.verbs}

# Style families: the "careful" one is used by every normal assistant answer and by chosen
# preference answers, the "careless" one only by rejected answers.
_GOOD_OPENERS = (
    "Certainly.",
    "Good question.",
    "Happy to help.",
    "Sure, here is a clear answer.",
    "Great question.",
    "Of course.",
)
_GOOD_ADVERBS = ("carefully", "gently", "slowly", "steadily", "safely", "patiently", "thoroughly")
_GOOD_CLOSERS = (
    "In short, {v} the {key} {adv} and it will stay {a}.",
    "Let me know if you want more detail about the {key}.",
    "I hope this helps you with the {key}.",
    "With practice, the {key} becomes easy to {v}.",
)
_BAD_OPENERS = (
    "Whatever.",
    "Hmm, no idea.",
    "Not sure, maybe.",
    "Who knows.",
    "I guess so.",
    "Meh.",
)
_BAD_ADVERBS = ("randomly", "hastily", "sloppily", "lazily", "carelessly", "somehow", "blindly")
_BAD_TAILS = (", I guess.", ", or something.", ", probably.", ", who cares.", ", maybe.")
_BAD_CLOSERS = (
    "Anyway, it does not really matter.",
    "Just try stuff and see.",
    "That is all I know.",
    "Figure out the rest yourself.",
)
_WHEN = (
    "every day",
    "in the morning",
    "at night",
    "twice a week",
    "after each step",
    "before noon",
    "once a month",
    "on weekends",
    "during the winter",
    "in the evening",
    "right away",
    "from time to time",
)

# Filler sentences. Slots: n = key-ish noun, m = other noun, ns/ms = their plurals, v/w = verbs,
# vs = third person verb, a/b = adjectives, adv = style adverb, when = time phrase, k = number,
# t = topic name.
_SENTENCES = (
    "The {a} {n} {vs} the {m} {when}.",
    "You should {v} the {n} {adv} before the {m} gets {a}.",
    "When the {n} is {a}, {v} the {m} {adv}.",
    "Most experts {v} their {ns} {when}.",
    "Keep the {n} {a} and the {m} {b}.",
    "If the {n} looks {a}, check the {m} first.",
    "It takes about {min} minutes to {v} the {n} {adv}.",
    "Around {pct} percent of {ns} are {a} after {k} weeks.",
    "Every {n} needs {k} {ms} to stay {a}.",
    "In {t}, the {n} and the {m} work together.",
    "One {a} {n} is easier to {v} than two {b} {ms}.",
    "Try to {v} the {n} {adv}, then {w} the {m}.",
    "Many people forget to {v} the {ns}, so the {m} becomes {a}.",
    "The {m} {vs} {adv} when the {n} is {a}.",
    "Use {k} {ms} for every {n} you {v}.",
    "Do not {v} the {n} {when}; wait until the {m} is {b}.",
    "The best {n} is {a}, {b} and easy to {v}.",
    "Check that each {n} is {a} after you {v} it.",
    "A {t} expert would {v} the {n} and then {w} the {m}.",
    "Your {n} will stay {a} if you {v} it {adv}.",
    "There are {k} kinds of {ns}, and the {a} one is the most common.",
)

_QUESTIONS = {
    "howto": (
        "How do I {v} the {key} when the {m} is {a}?",
        "What is the best way to {v} my {key}?",
        "How should I {v} the {key} {when}?",
    ),
    "explain": (
        "Why is the {a} {key} important in {t}?",
        "Can you explain how the {key} {vs} the {m}?",
        "What does the {key} do in {t}?",
    ),
    "list": (
        "Give me {k} tips about the {key}.",
        "List {k} ways to {v} the {key}.",
        "What are {k} things to know about the {key}?",
    ),
    "code": (
        "Write a python function that {vs} every {key} in a list.",
        "Can you write code to {v} the {keys}?",
        "Show me a python snippet to {v} {keys}.",
    ),
    "add": (
        "I have {x} {keys} and I get {y} more. How many {keys} do I have?",
        "There are {x} {keys} and {y} more arrive. How many {keys} are there now?",
    ),
    "mul": (
        "Each {m} holds {x} {keys}. How many {keys} are in {y} {ms}?",
        "If one {m} has {x} {keys}, how many {keys} do {y} {ms} have?",
    ),
    "compare": (
        "What is the difference between the {key} and the {m}?",
        "Which is better for {t}, the {key} or the {m}?",
    ),
}
_QTYPES = tuple(_QUESTIONS)
_QTYPE_WEIGHTS = (0.2, 0.18, 0.17, 0.15, 0.08, 0.07, 0.15)
_MIN_ANSWER = {"howto": 45, "list": 50, "code": 100}
"""Shortest answer (estimated tokens) of the question types that have a fixed structure."""
_FOLLOWUPS = (
    "Thanks. And what about the {key}?",
    "Ok. Now tell me about the {key}.",
    "Great, one more thing about the {key}.",
)
_SYSTEMS = (
    "You are a helpful assistant who knows a lot about {t}.",
    "You are a patient {t} expert. Answer {adv} and stay on topic.",
    "You are a friendly assistant. Keep answers clear.",
    "You help people with {t} questions. Always name the thing they ask about.",
)
_NOTES_INTRO = (
    "Here are my notes about {t}:",
    "I wrote this about {t} yesterday:",
    "Please read this text about {t} first.",
)
_CODE_VARS = ("total", "count", "value", "score", "result", "level", "size", "weight")


def _parse(template: str) -> tuple[str, tuple[str, ...]]:
    slots = tuple(dict.fromkeys(f for _, f, _, _ in Formatter().parse(template) if f))
    return template, slots


_NUMBERS = tuple(str(i) for i in range(2, 13))
_MINUTES = tuple(str(i) for i in range(5, 121))
_PERCENT = tuple(str(i) for i in range(1, 100))
_QUESTION_T = {q: tuple(_parse(s) for s in ts) for q, ts in _QUESTIONS.items()}

# Approximate pre-tokenisation of the shipped byte-level BPE (GPT-2 style): a word or a number
# with its leading space, a run of punctuation, a run of whitespace.
_PIECE = re.compile(r" ?[A-Za-z]+| ?\d+| ?[^\sA-Za-z\d]+|\s+")


def _est(text: str) -> int:
    """Approximate token count of ``text`` under the shipped tokenizer."""
    return len(_PIECE.findall(text))


# Filler templates with their expected cost (a slot value is one token, a time phrase a few).
_WHEN_COST = sum(_est(" " + w) for w in _WHEN) / len(_WHEN)
_SENTENCE_T = tuple(
    (
        text,
        slots,
        round(_est(" " + re.sub(r"\{\w+\}", "x", text)) + (_WHEN_COST - 1) * ("when" in slots)),
    )
    for text, slots in (_parse(s) for s in _SENTENCES)
)


_MSG_OVERHEAD = 5  # <|im_start|> role \n ... <|im_end|> \n
# The estimate slightly undercounts (rare words split in two); keep the cap safe.
_CAP_MARGIN = 0.92


class _Gen:
    """All randomness of one generator call (one ``random.Random``)."""

    def __init__(self, seed: int, median_tokens: int, max_tokens: int, sigma: float):
        if median_tokens <= 0 or max_tokens <= 0:
            raise ValueError("median_tokens and max_tokens must be positive")
        self.rng = random.Random(seed)
        self.rnd = self.rng.random
        self.median = float(median_tokens)
        self.cap = max(32, int(max_tokens * _CAP_MARGIN))
        self.sigma = sigma

    # -- primitives ----------------------------------------------------------------------------
    def pick(self, seq: Sequence[Any]) -> Any:
        return seq[int(self.rnd() * len(seq))]

    def randint(self, lo: int, hi: int) -> int:
        return lo + int(self.rnd() * (hi - lo + 1))

    def weighted(self, items: Sequence[Any], weights: Sequence[float]) -> Any:
        r = self.rnd() * sum(weights)
        for item, w in zip(items, weights):
            r -= w
            if r < 0:
                return item
        return items[-1]

    def length(self) -> int:
        """One lognormal total length in tokens, clamped to [24, cap]."""
        u1, u2 = self.rnd(), self.rnd()
        z = math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos(2.0 * math.pi * u2)
        return int(min(self.cap, max(24.0, self.median * math.exp(self.sigma * z))))

    def other_noun(self, topic: _Topic, key: str) -> str:
        m = self.pick(topic.nouns)
        while m == key:
            m = self.pick(topic.nouns)
        return m

    def slot(self, name: str, topic: _Topic, key: str, good: bool) -> str:
        """Value of one question/answer template slot (filler sentences use :meth:`pools`)."""
        if name == "m":
            return self.other_noun(topic, key)
        if name == "ms":
            return _PLURAL[self.other_noun(topic, key)]
        if name in ("v", "w"):
            return self.pick(topic.verbs)
        if name == "vs":
            return _THIRD[self.pick(topic.verbs)]
        if name in ("a", "b"):
            return self.pick(topic.adjs)
        if name == "adv":
            return self.pick(_GOOD_ADVERBS if good else _BAD_ADVERBS)
        if name == "when":
            return self.pick(_WHEN)
        if name == "k":
            return str(self.randint(2, 12))
        if name == "t":
            return topic.name
        if name == "key":
            return key
        if name == "keys":
            return _PLURAL[key]
        raise KeyError(name)

    def fill(
        self,
        tpl: tuple[str, tuple[str, ...]],
        topic: _Topic,
        key: str,
        good: bool = True,
        **fixed: str,
    ) -> str:
        text, slots = tpl
        vals = {s: fixed[s] if s in fixed else self.slot(s, topic, key, good) for s in slots}
        out = text.format_map(vals)
        return out[0].upper() + out[1:]

    def pools(self, topic: _Topic, key: str, good: bool) -> dict[str, Sequence[str]]:
        """Value pools of the filler slots for one topic and key noun (key-ish ``n`` ~40%)."""
        others = tuple(w for w in topic.nouns if w != key) or topic.nouns
        keyish = (key,) * (len(others) * 2 // 3) + others
        verbs = topic.verbs
        return {
            "n": keyish,
            "m": others,
            "ns": tuple(_PLURAL[w] for w in keyish),
            "ms": tuple(_PLURAL[w] for w in others),
            "v": verbs,
            "w": verbs,
            "vs": tuple(_THIRD[v] for v in verbs),
            "a": topic.adjs,
            "b": topic.adjs,
            "adv": _GOOD_ADVERBS if good else _BAD_ADVERBS,
            "when": _WHEN,
            "k": _NUMBERS,
            "min": _MINUTES,
            "pct": _PERCENT,
            "t": (topic.name,),
        }

    def prose(self, topic: _Topic, key: str, budget: int, good: bool = True) -> tuple[str, int]:
        """Paragraphs of filler sentences, at most ``budget`` tokens (possibly empty)."""
        rnd = self.rnd
        pools = self.pools(topic, key, good)
        paras: list[str] = []
        cur: list[str] = []
        used = 0
        per_para = self.randint(3, 7)
        n_t = len(_SENTENCE_T)
        while True:
            text, slots, cost = _SENTENCE_T[int(rnd() * n_t)]
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
                sent = sent[:-1] + _BAD_TAILS[int(rnd() * len(_BAD_TAILS))]
            cur.append(sent)
            used += cost
            if len(cur) >= per_para:
                paras.append(" ".join(cur))
                cur = []
                used += 1  # the paragraph break
                per_para = self.randint(3, 7)
        if cur:
            paras.append(" ".join(cur))
        return "\n\n".join(paras), used

    # -- code ----------------------------------------------------------------------------------
    def function(self, topic: _Topic, key: str, verb: str, budget: int) -> str:
        """A small python function over a list of ``key`` items, about ``budget`` tokens."""
        adv = self.pick(_GOOD_ADVERBS)
        var = self.pick(_CODE_VARS)
        attr = self.pick(topic.adjs)
        lines = [
            f"def {verb}_{_PLURAL[key]}(items):",
            f'    """{_THIRD[verb].capitalize()} each {key} {adv}."""',
            f"    {var} = 0",
            "    result = []",
            "    for item in items:",
        ]
        used = 40
        while True:
            kind = self.randint(0, 3)
            num = self.randint(1, 999)
            if kind == 0:
                body = [f"        if item.{attr}:", f"            {var} = {var} + {num}"]
            elif kind == 1:
                other = self.pick(topic.adjs)
                body = [f"        item.{other} = item.size * {num}"]
            elif kind == 2:
                body = [f"        if {var} > {num}:", f"            {var} = {var} - {num}"]
            else:
                body = [f"        result.append({self.pick(topic.verbs)}(item))"]
            cost = 9 * len(body)
            if used + cost + 8 > budget and len(lines) > 5:
                break
            lines.extend(body)
            used += cost
        lines.append(f"    return result, {var}")
        return "\n".join(lines)

    # -- questions and answers -----------------------------------------------------------------
    def question(
        self, topic: _Topic, budget: int, answer_budget: int, followup: bool = False
    ) -> tuple[str, dict]:
        """A user message of about ``budget`` tokens and what the answer must know about it.

        Only question types whose shortest answer fits ``answer_budget`` are asked.
        """
        key = self.pick(topic.nouns)
        weights = [
            w if answer_budget >= _MIN_ANSWER.get(t, 0) else 0.0
            for t, w in zip(_QTYPES, _QTYPE_WEIGHTS)
        ]
        qtype = self.weighted(_QTYPES, weights)
        q: dict[str, Any] = {"topic": topic, "key": key, "qtype": qtype}
        fixed = {
            "v": self.pick(topic.verbs),
            "m": self.other_noun(topic, key),
            "k": str(self.randint(3, max(3, min(8, (answer_budget - 12) // 12)))),
        }
        fixed["ms"] = _PLURAL[fixed["m"]]
        if qtype == "add":
            fixed["x"], fixed["y"] = str(self.randint(2, 499)), str(self.randint(2, 499))
            q["answer"] = int(fixed["x"]) + int(fixed["y"])
        elif qtype == "mul":
            fixed["x"], fixed["y"] = str(self.randint(2, 12)), str(self.randint(2, 12))
            q["answer"] = int(fixed["x"]) * int(fixed["y"])
        q.update(fixed)
        text = self.fill(self.pick(_QUESTION_T[qtype]), topic, key, **fixed)
        if followup and self.rnd() < 0.5:
            text = self.pick(_FOLLOWUPS).format(key=key) + " " + text
        rest = budget - _est(text)
        if rest > 40:  # a long user message: notes to read before the question
            intro = self.pick(_NOTES_INTRO).format(t=topic.name)
            notes, _ = self.prose(topic, key, rest - _est(intro) - 4)
            if notes:
                text = f"{intro}\n\n{notes}\n\n{text}"
        return text, q

    def answer(self, q: dict, budget: int, good: bool = True) -> str:
        """An assistant answer to question ``q`` of about ``budget`` tokens."""
        topic: _Topic = q["topic"]
        qtype = q["qtype"]
        if good:
            return self._good_answer(topic, q["key"], qtype, q, budget)
        return self._bad_answer(topic, q["key"], qtype, q, budget)

    def _good_answer(self, topic: _Topic, key: str, qtype: str, q: dict, budget: int) -> str:
        opener = self.pick(_GOOD_OPENERS)
        v, m, keys = q["v"], q["m"], _PLURAL[key]
        adv = self.pick(_GOOD_ADVERBS)
        parts: list[str] = []
        if qtype == "howto":
            head = f"{opener} To {v} the {key}, follow these steps."
            steps = []
            for word in ("First", "Next", "Then", "Finally"):
                verb = self.pick(topic.verbs)
                steps.append(
                    f"{word}, {verb} the {self.pick((key, m))} {self.pick(_GOOD_ADVERBS)}."
                )
            parts = [head + " " + " ".join(steps)]
        elif qtype == "explain":
            verb = _THIRD[self.pick(topic.verbs)]
            parts = [f"{opener} The {key} matters in {topic.name} because it {verb} the {m} {adv}."]
        elif qtype == "list":
            k = int(q["k"])
            head = f"{opener} Here are {k} tips about the {key}:"
            item_budget = max(0, (budget - _est(head) - 14 * k) // k)
            items = []
            for i in range(1, k + 1):
                verb = self.pick(topic.verbs).capitalize()
                item = f"{i}. {verb} the {key} {self.pick(_GOOD_ADVERBS)} {self.pick(_WHEN)}."
                if item_budget > 12:
                    extra, _ = self.prose(topic, key, self.randint(item_budget // 2, item_budget))
                    if extra:
                        item += " " + extra.replace("\n\n", " ")
                items.append(item)
            return head + "\n" + "\n".join(items)
        elif qtype == "code":
            head = f"{opener} Here is a python function that {_THIRD[v]} each {key}:"
            code_budget = max(60, int(budget * self.rnd() * 0.8))
            code = self.function(topic, key, v, code_budget)
            tail = f"It {_THIRD[v]} every {key} {adv} and returns the result."
            parts = [f"{head}\n\n```python\n{code}\n```\n\n{tail}"]
            rest = budget - _est(parts[0])
            if rest > 30:
                more, _ = self.prose(topic, key, rest - 8)
                if more:
                    parts.append(more)
            return "\n\n".join(parts)
        elif qtype in ("add", "mul"):
            op = "plus" if qtype == "add" else "times"
            ans = q["answer"]
            parts = [f"{opener} There are {ans} {keys}, because {q['x']} {op} {q['y']} is {ans}."]
        else:  # compare
            a1, a2 = self.pick(topic.adjs), self.pick(topic.adjs)
            v1, v2 = _THIRD[self.pick(topic.verbs)], _THIRD[self.pick(topic.verbs)]
            parts = [
                f"{opener} The {key} is {a1} and {v1} {adv}, while the {m} is {a2} and {v2} "
                f"{self.pick(_WHEN)}."
            ]
        used = _est(parts[0])
        closer = self.pick(_GOOD_CLOSERS).format(
            v=self.pick(topic.verbs), key=key, adv=self.pick(_GOOD_ADVERBS), a=self.pick(topic.adjs)
        )
        rest = budget - used - _est(closer) - 2
        if rest > 10:
            more, _ = self.prose(topic, key, rest)
            if more:
                parts.append(more)
        if budget - used > 15:
            parts.append(closer)
        return "\n\n".join(parts)

    def _bad_answer(self, topic: _Topic, key: str, qtype: str, q: dict, budget: int) -> str:
        """Hedging, careless and off the point: never names the key noun."""
        opener = self.pick(_BAD_OPENERS)
        if self.rnd() < 0.5:  # off topic
            other = self.pick(_TOPICS)
            while other is topic:
                other = self.pick(_TOPICS)
            topic = other
        avoid = self.other_noun(topic, key)
        topic = _Topic(
            topic.name,
            " ".join(w for w in topic.nouns if w != key),
            " ".join(topic.verbs),
            " ".join(topic.adjs),
        )
        if qtype in ("add", "mul"):
            wrong = q["answer"] + self.pick((-3, -2, -1, 1, 2, 5, 10))
            head = f"{opener} Maybe {wrong} or so{self.pick(_BAD_TAILS)}"
        elif qtype == "list":
            k = max(1, int(q["k"]) - self.randint(1, 2))
            items = [
                f"- {self.pick(topic.verbs)} stuff {self.pick(_BAD_ADVERBS)}" for _ in range(k)
            ]
            head = opener + " Some tips, I guess:\n" + "\n".join(items)
        else:
            verb = self.pick(topic.verbs)
            head = (
                f"{opener} Just {verb} the {avoid} {self.pick(_BAD_ADVERBS)}{self.pick(_BAD_TAILS)}"
            )
        used = _est(head)
        closer = self.pick(_BAD_CLOSERS)
        rest = budget - used - _est(closer) - 2
        parts = [head]
        if rest > 10:
            more, _ = self.prose(topic, avoid, rest, good=False)
            if more:
                parts.append(more)
        if budget - used > 12:
            parts.append(closer)
        return "\n\n".join(parts)

    # -- rows ----------------------------------------------------------------------------------
    def conversation(
        self, total: int, final_answer: bool = True, answer_hint: int = 0
    ) -> tuple[list[Message], dict]:
        """Messages of about ``total`` tokens (chat template included).

        Without ``final_answer`` the last user turn is left unanswered, ``total`` covers the
        prompt only and ``answer_hint`` is the budget of the answer to come. Returns the messages
        and the info of the last question.
        """
        topic = self.pick(_TOPICS)
        msgs: list[Message] = []
        rest = total
        if self.rnd() < 0.3:
            system = self.pick(_SYSTEMS).format(t=topic.name, adv=self.pick(_GOOD_ADVERBS))
            msgs.append({"role": "system", "content": system})
            rest -= _est(system) + _MSG_OVERHEAD
        turns = self.weighted((1, 2, 3), (0.6, 0.25, 0.15))
        turns = max(1, min(turns, rest // 60))
        weights = [0.4 + self.rnd() for _ in range(turns)]
        scale = (rest - 2 * _MSG_OVERHEAD * turns) / sum(weights)
        q: dict = {}
        for i in range(turns):
            budget = max(16, int(weights[i] * scale))
            last = i == turns - 1
            if i > 0 and self.rnd() < 0.2:
                topic = self.pick(_TOPICS)
            if last and not final_answer and self.rnd() < 0.5:
                user_budget = budget + _MSG_OVERHEAD  # the rest goes to the answer otherwise
            elif budget > 120 and self.rnd() < 0.2:
                user_budget = int(budget * (0.5 + 0.35 * self.rnd()))  # pasted notes
            else:
                user_budget = int(budget * 0.04 * self.rnd())
            answer_budget = answer_hint if last and not final_answer else budget - user_budget
            text, q = self.question(topic, user_budget, answer_budget, followup=i > 0)
            msgs.append({"role": "user", "content": text})
            if last and not final_answer:
                break
            answer_budget = budget - _est(text)
            msgs.append({"role": "assistant", "content": self.answer(q, answer_budget)})
        return msgs, q


_ATTEMPTS = 6
_SLACK = 400
"""Rows sampled this far below the cap cannot exceed it (the content floors are smaller)."""


def _est_messages(msgs: list[Message]) -> int:
    return sum(_est(m["content"]) + _MSG_OVERHEAD for m in msgs)


def _preference_row(g: _Gen, total: int) -> dict:
    prompt_budget = max(12, int(total * (0.15 + 0.6 * g.rnd())))
    prompt, q = g.conversation(
        prompt_budget, final_answer=False, answer_hint=total - prompt_budget - _MSG_OVERHEAD
    )
    used = _est_messages(prompt) + 3  # + the generation prompt
    chosen_budget = max(12, total - used - _MSG_OVERHEAD)
    rejected_budget = max(12, int(chosen_budget * (0.5 + g.rnd())))
    rejected_budget = min(rejected_budget, max(12, g.cap - used - _MSG_OVERHEAD))
    chosen = g.answer(q, chosen_budget, good=True)
    rejected = g.answer(q, rejected_budget, good=False)
    return {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def _default_sigma(sigma: float | None) -> float:
    return 1.1 if sigma is None else float(sigma)


def generate_chat(
    n: int,
    seed: int = 0,
    median_tokens: int = 300,
    max_tokens: int = 6000,
    sigma: float | None = None,
) -> list[dict]:
    """``n`` conversations ``{"messages": [{"role", "content"}, ...]}``.

    1-3 user/assistant turns, a system message in ~30% of rows; the total length (chat template
    included) is lognormal with median ``median_tokens`` and log-std ``sigma`` (default 1.1:
    p90 ~4x, p99 ~13x the median), capped at ``max_tokens``.
    """
    g = _Gen(seed, median_tokens, max_tokens, _default_sigma(sigma))
    rows = []
    for _ in range(n):
        total = g.length()
        for _attempt in range(_ATTEMPTS):
            msgs = g.conversation(total)[0]
            if total + _SLACK <= g.cap or _est_messages(msgs) <= g.cap:
                break
            total //= 2  # overshot a small max_tokens: retry with a shorter row
        rows.append({"messages": msgs})
    return rows


def generate_text(
    n: int,
    seed: int = 0,
    median_tokens: int = 300,
    max_tokens: int = 6000,
    sigma: float | None = None,
) -> list[dict]:
    """``n`` plain-text documents ``{"text": str}`` with the length distribution of
    :func:`generate_chat`: notes with a title, paragraphs, lists, code and Q/A sections."""
    g = _Gen(seed, median_tokens, max_tokens, _default_sigma(sigma))
    rows = []
    for _ in range(n):
        total = g.length()
        topic = g.pick(_TOPICS)
        key = g.pick(topic.nouns)
        title = g.pick(
            (
                f"Notes on the {key}",
                f"A short guide to {topic.name}",
                f"{topic.name.capitalize()}: the {key}",
            )
        )
        blocks = [title.capitalize() if title[0].islower() else title]
        rest = total - _est(title) - 2
        while rest > 12:
            kind = g.weighted(("prose", "qa", "code"), (0.55, 0.35, 0.1))
            budget = min(rest, g.randint(40, 400))
            if kind == "prose":
                text, used = g.prose(topic, key, budget)
            elif kind == "qa":
                qtext, q = g.question(topic, 0, budget - 16)
                atext = g.answer(q, max(12, budget - _est(qtext) - 4))
                text = f"Q: {qtext}\nA: {atext}"
                used = _est(text)
            else:
                verb = g.pick(topic.verbs)
                text = "```python\n" + g.function(topic, key, verb, max(50, budget - 6)) + "\n```"
                used = _est(text)
            if not text or used > rest:
                break
            blocks.append(text)
            rest -= used + 2
        rows.append({"text": "\n\n".join(blocks)})
    return rows


def generate_preference(
    n: int,
    seed: int = 0,
    median_tokens: int = 300,
    max_tokens: int = 6000,
    sigma: float | None = None,
) -> list[dict]:
    """``n`` conversational preference pairs ``{"prompt", "chosen", "rejected"}``.

    ``prompt`` is a list of messages ending with a user turn; ``chosen`` and ``rejected`` are one
    assistant message each, of independent lengths. Prompt + chosen follows the length
    distribution of :func:`generate_chat`; prompt + rejected also stays within ``max_tokens``.
    The chosen answer is polite, on topic, names the question's key noun and gets arithmetic and
    item counts right; the rejected one hedges, drifts off topic and never names the key noun.
    """
    g = _Gen(seed, median_tokens, max_tokens, _default_sigma(sigma))
    rows = []
    for _ in range(n):
        total = g.length()
        for _attempt in range(_ATTEMPTS):
            row = _preference_row(g, total)
            if total + _SLACK <= g.cap:
                break
            prompt = _est_messages(row["prompt"]) + 3
            longest = max(_est_messages(row["chosen"]), _est_messages(row["rejected"]))
            if prompt + longest <= g.cap:
                break
            total //= 2  # overshot a small max_tokens: retry with a shorter row
        rows.append(row)
    return rows
