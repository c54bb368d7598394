"""memlab's imports point one way, and nothing patches a memlab module.

Layers, top to bottom (docs/architecture.md, "Dependencies point one way"; issue 13):

    0  entry points: memlab.__main__, memlab.cli.*, the launch modes (memlab.hydra_task,
       memlab.rank, memlab.torchrun)
    1  memlab.run, memlab.record, memlab.rundir, memlab.estimate.*   (one job, its record and
       its directory / one estimate)
    2  memlab.pipeline                      (the one assembly)
    3  memlab.context                       (the typed context and validate)
    4  technique packages: method, generation, packing, attention, precision, offload, peft,
       optimizer, distributed, model, data, logger
    5  trainer, losses, measure, registry, config, resolvers, _guards, faults, memlab (the
       package)

Every import of every module is read with ``ast`` (module level and inside functions); an import
of a higher layer fails the test, and so does any import cycle (between modules, and between the
technique packages of layer 4, which may import each other only one way).

Imports under ``if TYPE_CHECKING:`` are for annotations only and never run: the group modules
name :class:`memlab.context.BuildContext` in their signatures, and the context names the groups'
Protocols, so the types point both ways while the code points one way. They are left out here
(mypy checks them).

The layers are the static import graph: a module imported by its name at run time is not seen
here (``registry.load_all`` imports every option with ``importlib``; the trainer reaches the
groups only through their Protocols, on the objects the pipeline hands it).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[3] / "src" / "memlab"

TECHNIQUES = ("method", "generation", "packing", "attention", "precision", "offload", "peft",
              "optimizer", "distributed", "model", "data", "logger")
BOTTOM = ("trainer", "losses", "measure", "registry", "config", "_guards", "resolvers", "faults")


def layer(module: str) -> int:
    """The layer of a memlab module name (``memlab.x.y``)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    if top in ("__main__", "cli", "hydra_task", "rank", "torchrun"):
        return 0
    if top in ("run", "record", "rundir", "estimate"):
        return 1
    if top == "pipeline":
        return 2
    if top == "context":
        return 3
    if top in TECHNIQUES:
        return 4
    if top in BOTTOM or top == "":
        return 5
    raise AssertionError(f"{module}: no layer assigned; add memlab.{top} to the layer map of "
                         "tests/unit/core/test_layers.py (and to the layer table of docs/architecture.md)")


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@functools.cache
def parsed(path: Path) -> ast.Module:
    """Each module parsed once for every test of this file (the check tier's 5 s each)."""
    return ast.parse(path.read_text())


@functools.cache
def imports(path: Path, type_only: bool = False) -> list[tuple[str, int, bool]]:
    """Every memlab module ``path`` imports at run time: (name, line, inside a function); with
    ``type_only``, those it imports for annotations only (under ``if TYPE_CHECKING:``)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node, in_function, for_types in _walk(parsed(path), False, False):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from memlab.x import y` may import the submodule memlab.x.y
            for a in node.names:
                sub = f"{base}.{a.name}"
                names.append(sub if (SRC.parent / (sub.replace(".", "/") + ".py")).exists()
                             or (SRC.parent / sub.replace(".", "/")).is_dir() else base)
        if for_types != type_only:
            continue
        for n in names:
            if n == "memlab" or n.startswith("memlab."):
                out.append((n, node.lineno, in_function))
    return out


def _walk(node: ast.AST, in_function: bool, for_types: bool):
    """Every statement under ``node`` (itself first) with whether it sits inside a function and
    inside the body of an ``if TYPE_CHECKING:``: one pass over the tree, through statements only
    (an import is always a statement)."""
    yield node, in_function, for_types
    inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    typing_if = isinstance(node, ast.If) and _type_checking(node.test)
    for field, value in ast.iter_fields(node):
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
                yield from _walk(child, inner, for_types or (typing_if and field == "body"))


def graph() -> dict[str, list[tuple[str, int, bool]]]:
    return {module_name(p): imports(p) for p in sorted(SRC.rglob("*.py"))}


def test_no_module_imports_a_higher_layer():
    bad = []
    for mod, deps in graph().items():
        for dep, line, inner in deps:
            if layer(dep) < layer(mod):
                bad.append(f"{mod} (layer {layer(mod)}) imports {dep} (layer {layer(dep)}) at "
                           f"line {line}" + (" inside a function" if inner else ""))
    assert not bad, "upward imports:\n  " + "\n  ".join(bad)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def _resolve(dep: str, modules: set[str]) -> str:
    while dep not in modules and "." in dep:
        dep = dep.rpartition(".")[0]
    return dep


def test_no_import_cycle_between_modules():
    g = graph()
    modules = set(g)
    edges = {m: {_resolve(d, modules) for d, _, _ in deps} - {m} for m, deps in g.items()}
    cycles = _cycles(edges)
    assert not cycles, "import cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in cycles)


def test_technique_packages_import_each_other_one_way():
    edges: dict[str, set[str]] = {}
    for mod, deps in graph().items():
        src = mod.split(".")[1] if "." in mod else ""
        if src not in TECHNIQUES:
            continue
        for dep, _, _ in deps:
            dst = dep.split(".")[1] if "." in dep else ""
            if dst in TECHNIQUES and dst != src:
                edges.setdefault(src, set()).add(dst)
    cycles = _cycles(edges)
    assert not cycles, "packages importing each other:\n  " + "\n  ".join(
        " <-> ".join(c) for c in cycles)


def test_the_layer_test_sees_what_it_checks():
    """Negative control: the walker finds imports inside functions and relative imports, and an
    upward import is caught."""
    deps = {d for d, _, inner in imports(SRC / "run.py") if inner}
    assert "memlab.pipeline" in deps  # imported inside _train
    assert layer("memlab.trainer.loop") > layer("memlab.method") > layer("memlab.context") \
        > layer("memlab.pipeline") > layer("memlab.run")
    # an annotation-only import is seen as one, and only as one
    assert "memlab.context" in {d for d, _, _ in imports(SRC / "config.py", type_only=True)}
    assert "memlab.context" not in {d for d, _, _ in imports(SRC / "config.py")}
    with pytest.raises(AssertionError, match="no layer assigned"):
        layer("memlab.somethingnew")


def test_no_memlab_module_is_patched():
    """memlab changes third-party code only in memlab.measure.patches; no module assigns an
    attribute of a memlab module at run time (``setattr(memlab_module, ...)`` or
    ``module.attr = ...`` on an imported memlab module)."""
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        tree = parsed(path)
        memlab_aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("memlab"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if (SRC.parent / (sub.replace(".", "/") + ".py")).exists() or \
                            (SRC.parent / sub.replace(".", "/")).is_dir():
                        memlab_aliases.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("memlab"):
                        memlab_aliases.add(a.asname or a.name.split(".")[0])
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and \
                        t.value.id in memlab_aliases:
                    bad.append(f"{path.relative_to(SRC.parent)}:{node.lineno}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id == "setattr" and node.args and \
                    isinstance(node.args[0], ast.Name) and node.args[0].id in memlab_aliases:
                bad.append(f"{path.relative_to(SRC.parent)}:{node.lineno}")
    assert not bad, "memlab modules patched at:\n  " + "\n  ".join(bad)
