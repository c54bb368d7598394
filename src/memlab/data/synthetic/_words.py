"""The word tables of the synthetic corpus: topics and their words, the careful and careless
style words, the filler-sentence, question and prompt templates.

Data only; which words a row uses is drawn in the other modules. Changing any table changes
every generated row (and the shipped tokenizer was trained on this text).
"""

from __future__ import annotations

# ----------------------------------------------------------------------------------------------
# Vocabulary: topic -> (nouns, verbs, adjectives). Nouns take a regular plural, verbs a regular
# third person; every word is lower case.
# ----------------------------------------------------------------------------------------------
TOPIC_TABLE = {
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


class Topic:
    """One topic's name and word lists."""

    __slots__ = ("name", "nouns", "verbs", "adjs")

    def __init__(self, name: str, nouns: str, verbs: str, adjs: str):
        self.name = name
        self.nouns = tuple(nouns.split())
        self.verbs = tuple(verbs.split())
        self.adjs = tuple(adjs.split())


TOPICS: tuple[str, ...] = tuple(TOPIC_TABLE)
"""Topic names of the synthetic corpus."""
ALL_TOPICS = tuple(Topic(name, *words) for name, words in TOPIC_TABLE.items())


def plural(word: str) -> str:
    """The plural of a noun (also the third person of a verb) in the tables."""
    if word == "tomato":
        return "tomatoes"
    if word.endswith(("s", "x", "ch", "sh", "z")):
        return word + "es"
    if word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + "s"


PLURAL = {n: plural(n) for t in ALL_TOPICS for n in t.nouns}
THIRD = {v: plural(v) for t in ALL_TOPICS for v in t.verbs}

# Style families: the "careful" one is used by every normal assistant answer and by chosen
# preference answers, the "careless" one only by rejected answers.
GOOD_OPENERS = (
    "Certainly.",
    "Good question.",
    "Happy to help.",
    "Sure, here is a clear answer.",
    "Great question.",
    "Of course.",
)
GOOD_ADVERBS = ("carefully", "gently", "slowly", "steadily", "safely", "patiently", "thoroughly")
GOOD_CLOSERS = (
    "In short, {v} the {key} {adv} and it will stay {a}.",
    "Let me know if you want more detail about the {key}.",
    "I hope this helps you with the {key}.",
    "With practice, the {key} becomes easy to {v}.",
)
BAD_OPENERS = (
    "Whatever.",
    "Hmm, no idea.",
    "Not sure, maybe.",
    "Who knows.",
    "I guess so.",
    "Meh.",
)
BAD_ADVERBS = ("randomly", "hastily", "sloppily", "lazily", "carelessly", "somehow", "blindly")
BAD_TAILS = (", I guess.", ", or something.", ", probably.", ", who cares.", ", maybe.")
BAD_CLOSERS = (
    "Anyway, it does not really matter.",
    "Just try stuff and see.",
    "That is all I know.",
    "Figure out the rest yourself.",
)
WHEN = (
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
SENTENCES = (
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

QUESTIONS = {
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
QTYPES = tuple(QUESTIONS)
QTYPE_WEIGHTS = (0.2, 0.18, 0.17, 0.15, 0.08, 0.07, 0.15)
MIN_ANSWER = {"howto": 45, "list": 50, "code": 100}
"""Shortest answer (estimated tokens) of the question types that have a fixed structure."""
FOLLOWUPS = (
    "Thanks. And what about the {key}?",
    "Ok. Now tell me about the {key}.",
    "Great, one more thing about the {key}.",
)
SYSTEMS = (
    "You are a helpful assistant who knows a lot about {t}.",
    "You are a patient {t} expert. Answer {adv} and stay on topic.",
    "You are a friendly assistant. Keep answers clear.",
    "You help people with {t} questions. Always name the thing they ask about.",
)
NOTES_INTRO = (
    "Here are my notes about {t}:",
    "I wrote this about {t} yesterday:",
    "Please read this text about {t} first.",
)
CODE_VARS = ("total", "count", "value", "score", "result", "level", "size", "weight")
NUMBERS = tuple(str(i) for i in range(2, 13))
MINUTES = tuple(str(i) for i in range(5, 121))
PERCENT = tuple(str(i) for i in range(1, 100))
