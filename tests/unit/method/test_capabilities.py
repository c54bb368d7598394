"""What every method answers stays small (issue 42): :class:`memlab.protocols.Method` declares
at most 16 members, those of the Protocols it extends included, and what only some methods have
is an ``as_<capability>()`` query that some registered method answers with None and some with
itself."""

from __future__ import annotations

from typing import Protocol

from memlab.protocols import Method
from memlab.registry import lookup, options

MAX_MEMBERS = 16


def protocol_members(proto: type) -> set[str]:
    """The members ``proto`` and every Protocol it extends declare (attributes, annotated class
    variables, methods), leaving out dunder names (the dataclass marker ``Option`` declares)."""
    names: set[str] = set()
    for cls in proto.__mro__:
        if cls in (Protocol, object) or not getattr(cls, "_is_protocol", False):
            continue
        names.update(vars(cls).get("__annotations__", {}))
        names.update(k for k, v in vars(cls).items() if callable(v) or isinstance(v, property))
    return {n for n in names if not n.startswith("_")}


def test_method_declares_at_most_16_members():
    members = protocol_members(Method)
    assert {"name", "validate", "prepare", "collate", "loss", "row_layout"} <= members
    assert len(members) <= MAX_MEMBERS, sorted(members)


def test_each_capability_is_had_by_some_methods_and_not_by_others():
    queries = sorted(m for m in protocol_members(Method) if m.startswith("as_"))
    assert {"as_generating", "as_group_packed", "as_liger", "as_extra_models",
            "as_pinnable"} <= set(queries)
    methods = {name: lookup("method", name)() for name in options("method")}
    for query in queries:
        answers = {name: getattr(m, query)() for name, m in methods.items()}
        has = sorted(name for name, a in answers.items() if a is not None)
        lacks = sorted(name for name, a in answers.items() if a is None)
        assert has and lacks, (query, has, lacks)
        assert all(answers[name] is methods[name] for name in has), query


def test_a_method_with_liger_knobs_answers_as_a_liger_user():
    """``method.use_liger_kernel`` (the Liger knobs) and the Liger capability go together: the
    pipeline applies Liger's kernels, and the estimate, FSDP2 and LoRA on the head refuse what
    Liger cannot do, only for a method whose ``as_liger()`` answers. (dpo and kto answered None:
    the capability their shared mixin declared was shadowed by ``NoCapabilities`` in their MRO.)"""
    from memlab.method._liger import LigerKnobs

    methods = {name: lookup("method", name)() for name in options("method")}
    knobs = sorted(n for n, m in methods.items() if isinstance(m, LigerKnobs))
    users = sorted(n for n, m in methods.items() if m.as_liger() is not None)
    assert {"sft", "dpo", "kto"} <= set(knobs) and users == knobs
