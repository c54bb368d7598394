"""The typed registry: one dict per config group, one decorator, one typed constructor.

Every option of every group is a ``@dataclass(kw_only=True)`` registered under the same name as
its yaml file (``conf/<group>/<name>.yaml``) and its module (``memlab/<group>/<name>.py``). It
registers through its group's typed ``register`` (``memlab/<group>/base.py``), which mypy
checks: a class that does not conform to the group's Protocol is a type error where it is
registered (``Value of type variable "MethodClass" of function cannot be "SFT"``; passing an
instance to a function typed with the Protocol makes mypy list the conflicting members). Every
group Protocol (:mod:`memlab.protocols`) extends :class:`Option`.
``build(group, node)`` turns a plain mapping from Hydra into that dataclass, reporting *every*
problem (unknown option, unknown key, wrong type, a number out of its range) instead of stopping
at the first.

Every numeric knob declares its range in its annotation, where a reader sees it with the type:
``lr: PositiveFloat = 3e-4``, ``max_length: Annotated[int, Range(ge=2)] | None = 1024`` (the
aliases below cover the common cases; a test checks that no int / float knob goes without one).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    ClassVar,
    Literal,
    Protocol,
    TypeVar,
    Union,
    get_args,
    get_origin,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

GROUPS = (
    "method",
    "generation",
    "packing",
    "attention",
    "precision",
    "offload",
    "peft",
    "optimizer",
    "distributed",
    "model",
    "data",
    "logger",
)
"""Config groups whose options are registered here (each has ``conf/<group>/``)."""


class Option(Protocol):
    """What every registered option is: a dataclass of its knobs whose class carries its option
    name (set by :func:`register`), and that checks itself against the run's other choices.
    Every group's Protocol extends this one; option classes name it as a base (directly or
    through their group's shared base) to declare ``name``."""

    name: ClassVar[str] = ""
    """The option's key: ``<group>=<name>`` on the command line, its yaml and module name (set
    by :func:`register`)."""
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def validate(self, ctx: Any) -> list[str]:
        """Every problem of this choice in the run ``ctx`` (each naming its fix); loads
        nothing. ``ctx`` is the run's :class:`memlab.protocols.BuildContext`, typed as such by
        :class:`memlab.protocols.GroupOption`, which every group's Protocol extends (named
        here it would make a loop: the context names the options)."""
        ...


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric knob accepts, declared in its annotation
    (``Annotated[float, Range(gt=0)]``). Bounds left None are open; NaN and infinities are
    never accepted."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def describe(self) -> str:
        """``"> 0"``, ``">= 1"``, ``"in [0, 1)"``, ``"finite"``."""
        low = (f"[{_num(self.ge)}" if self.ge is not None
               else f"({_num(self.gt)}" if self.gt is not None else None)
        high = (f"{_num(self.le)}]" if self.le is not None
                else f"{_num(self.lt)})" if self.lt is not None else None)
        if low and high:
            return f"in {low}, {high}"
        if low:
            return (">= " if low[0] == "[" else "> ") + low[1:]
        if high:
            return ("<= " if high[-1] == "]" else "< ") + high[:-1]
        return "finite"

    def check(self, value: float) -> str | None:
        """None if ``value`` is in range, else the reason."""
        ok = math.isfinite(value) and not (
            (self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt))
        return None if ok else f"must be {self.describe()}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


PositiveInt = Annotated[int, Range(ge=1)]
"""An int >= 1 (steps, sizes, counts)."""
NonNegativeInt = Annotated[int, Range(ge=0)]
"""An int >= 0 (0 usually meaning 'none' or 'off')."""
PositiveFloat = Annotated[float, Range(gt=0)]
"""A float > 0 (a learning rate, a temperature, a timeout)."""
NonNegativeFloat = Annotated[float, Range(ge=0)]
"""A float >= 0 (a weight decay, a loss weight, a KL coefficient)."""
Fraction = Annotated[float, Range(ge=0, le=1)]
"""A float in [0, 1] (a probability, a share of memory)."""
Seed = Annotated[int, Range(ge=0, lt=2**32)]
"""A random seed (numpy accepts [0, 2**32))."""
Port = Annotated[int, Range(ge=0, le=65535)]
"""A TCP port (0: a free one)."""

_REGISTRY: dict[str, dict[str, type[Option]]] = {g: {} for g in GROUPS}
Opt = TypeVar("Opt", bound=Option)
D = TypeVar("D", bound="DataclassInstance")


def register(group: str, name: str) -> Callable[[type[Opt]], type[Opt]]:
    """Register a config dataclass as option ``name`` of ``group`` (option modules use their
    group's typed ``register``, which calls this one)."""
    if group not in _REGISTRY:
        raise KeyError(f"unknown config group {group!r}; groups: {', '.join(GROUPS)}")

    def deco(cls: type[Opt]) -> type[Opt]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass to be registered")
        if any(f.name == "name" for f in dataclasses.fields(cls)):
            raise TypeError(f"{cls.__name__}: 'name' is the option key; call the field otherwise")
        if name in _REGISTRY[group] and _REGISTRY[group][name] is not cls:
            raise KeyError(f"{group}={name} registered twice")
        cls.name = name
        _REGISTRY[group][name] = cls
        return cls

    return deco


def options(group: str) -> list[str]:
    """Registered option names of a group, sorted."""
    load_all()
    return sorted(_REGISTRY[group])


def lookup(group: str, name: str) -> type[Option]:
    """The config class of ``group=name``; KeyError naming the valid options otherwise."""
    load_all()
    try:
        return _REGISTRY[group][name]
    except KeyError:
        raise KeyError(
            f"{group}={name!r} is not an option; choose one of: {', '.join(options(group))}"
        ) from None


_LOADED = False


def load_all() -> None:
    """Import every option module so that its ``@register`` has run (idempotent, cheap)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import importlib
    import pkgutil

    for group in GROUPS:
        pkg = importlib.import_module(f"memlab.{group}")
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.startswith("_") and info.name != "base":
                importlib.import_module(f"memlab.{group}.{info.name}")


class ConfigErrors(ValueError):
    """Every problem found in a configuration, reported together."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        body = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"invalid configuration ({len(self.errors)} problem(s)):\n{body}")


def build(group: str, node: Mapping[str, Any], where: str | None = None,
          partial: bool = False) -> tuple[Option | None, list[str]]:
    """Turn a Hydra group node ``{name: ..., knob: ...}`` into its typed config.

    Returns ``(config_or_None, errors)``; never raises for user mistakes. ``partial``: as in
    :func:`from_mapping`.
    """
    where = where or group
    node = dict(node)
    name = node.pop("name", None)
    if name is None:
        return None, [f"{where}: missing 'name:' (one of: {', '.join(options(group))})"]
    try:
        cls = lookup(group, str(name))
    except KeyError as e:
        return None, [str(e.args[0])]
    return from_mapping(cls, node, f"{where} ({name})", partial=partial)


def from_mapping(cls: type[D], data: Mapping[str, Any], where: str,
                 partial: bool = False, renamed: Callable[[str], str | None] | None = None
                 ) -> tuple[D | None, list[str]]:
    """Construct dataclass ``cls`` from ``data`` with type and range checks; collect every
    error. With errors the object is None, unless ``partial``: then it is built from the values
    that passed (defaults for the others), so that the checks that follow can still run and
    every problem of a configuration is reported at once (None when even that fails).
    ``renamed(key)``: what to use instead of an unknown key that is another library's name
    for a knob (:func:`memlab.config.trl_hint`), or None."""
    errors: list[str] = []
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    moved: Mapping[str, str] = getattr(cls, "moved_keys", {})
    for key, value in data.items():
        if key not in fields and key in moved:
            errors.append(f"{where}.{key} has moved: {moved[key]}")
            continue
        if key not in fields:
            other = renamed(f"{where}.{key}") if renamed is not None else None
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = (f"; {other}" if other else f"; did you mean {close[0]!r}?" if close
                    else "")
            errors.append(
                f"{where}: unknown key {key!r}{hint} (valid keys: {', '.join(sorted(fields))})"
            )
            continue
        ok, converted, why = _check(value, hints[key])
        if not ok:
            errors.append(f"{where}.{key}: {why} (got {value!r})")
            continue
        kwargs[key] = converted
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and not any(e.startswith(f"{where}.{n}:") for e in errors)
    ]
    for n in missing:
        errors.append(f"{where}: missing required key {n!r}")
    if errors and not partial:
        return None, errors
    try:
        return cls(**kwargs), errors
    except Exception:  # noqa: BLE001 - a required value is missing: nothing to check further
        return None, errors


def numeric_knobs(cls: type) -> dict[str, Range | None]:
    """Every field of ``cls`` whose type holds an int or a float (bare, optional, in a list or a
    union), with its declared :class:`Range` (None: none declared)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out: dict[str, Range | None] = {}
    for f in dataclasses.fields(cls):
        found: list[Range | None] = []
        _ranges(hints[f.name], None, found)
        if found:
            out[f.name] = next((r for r in found if r is not None), None)
    return out


def _ranges(tp: Any, rng: Range | None, found: list[Range | None]) -> None:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *meta = get_args(tp)
        own = next((m for m in meta if isinstance(m, Range)), rng)
        _ranges(base, own, found)
    elif tp in (int, float):
        found.append(rng)
    elif origin is not Literal:
        for arg in get_args(tp):
            _ranges(arg, rng, found)


def _check(value: Any, tp: Any) -> tuple[bool, Any, str]:
    """Check ``value`` against annotation ``tp``; returns (ok, converted value, reason)."""
    if tp is Any:
        return True, value, ""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *meta = get_args(tp)
        ok, conv, why = _check(value, base)
        if ok:
            for m in meta:
                bad = m.check(conv) if isinstance(m, Range) else None
                if bad:
                    return False, value, bad
        return ok, conv, why
    if origin is Literal:
        allowed = get_args(tp)
        if value in allowed:
            return True, value, ""
        return False, value, f"must be one of {', '.join(repr(a) for a in allowed)}"
    if origin in (Union, types.UnionType):
        reasons = []
        for arg in get_args(tp):
            if arg is type(None):
                if value is None:
                    return True, None, ""
                continue
            ok, conv, why = _check(value, arg)
            if ok:
                return True, conv, ""
            reasons.append(why)
        if type(None) in get_args(tp):
            reasons.append("null")
        return False, value, " or ".join(r for r in reasons if r) or "has the wrong type"
    if tp is type(None):
        return (value is None), value, "must be null"
    if tp is bool:
        return isinstance(value, bool), value, "must be true or false"
    if tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return ok, value, "must be an integer"
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value, "must be a number"
    if tp is str:
        return isinstance(value, str), value, "must be a string"
    if origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            return False, value, "must be a list"
        args = get_args(tp)
        item_tp = args[0] if args else Any
        out = []
        for i, item in enumerate(value):
            ok, conv, why = _check(item, item_tp)
            if not ok:
                return False, value, f"item {i} {why}"
            out.append(conv)
        return True, (tuple(out) if origin is tuple else out), ""
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            return False, value, "must be a mapping"
        return True, dict(value), ""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            return False, value, "must be a mapping"
        obj, errs = from_mapping(tp, value, tp.__name__)
        return (obj is not None), obj, "; ".join(errs)
    return isinstance(value, tp), value, f"must be {getattr(tp, '__name__', tp)}"
