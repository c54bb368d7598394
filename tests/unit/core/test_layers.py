"""memlab's imports point one way, and nothing patches a memlab module.

Layers, top to bottom (docs/architecture.md, "Dependencies point one way"; issue 13):

    0  entry points: memlab.__main__, memlab.cli.*, the launch modes (memlab.hydra_task,
       memlab.rank, memlab.torchrun)
    1  memlab.run, memlab.record, memlab.rundir, memlab.estimate.*   (one job, its record and
       its directory / one estimate)
    2  memlab.pipeline                      (the one assembly)
    3  memlab.context                       (validate, which makes the typed context)
    4  technique packages: method, generation, packing, attention, precision, offload, peft,
       optimizer, distributed, model, data, logger
    5  protocols (the contracts: the context's type and the group Protocols), trainer, losses,
       measure, registry, config, resolvers, _guards, faults, memlab (the package)

Every import of every module is read with ``ast`` (module level and inside functions); an import
of a higher layer fails the test.

The import graph has no cycle (issue 42), counting every edge: the imports that run, those
under ``if TYPE_CHECKING:`` (for annotations only), and a memlab module named in a string
annotation or a ``cast`` (``"memlab.x.Y"``). Between the technique packages of layer 4 it points
one way too. The types are what made the old circle (the context named every group's Protocol
and every group named the context): they now live in :mod:`memlab.protocols`, which names
neither. The layer rule reads the imports that run only: a group module may name
``memlab.context.BuildContext`` (which is :class:`memlab.protocols.BuildContext`) for its
annotations.

The layers are the static import graph: a module imported by its name at run time is not seen
here (``registry.load_all`` imports every option with ``importlib``; the trainer reaches the
groups only through their Protocols, on the objects the pipeline hands it).
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[3] / "src" / "memlab"

TECHNIQUES = ("method", "generation", "packing", "attention", "precision", "offload", "peft",
              "optimizer", "distributed", "model", "data", "logger")
BOTTOM = ("protocols", "trainer", "losses", "measure", "registry", "config", "_guards", "resolvers",
          "faults")


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


_DOTTED = re.compile(r"\bmemlab(?:\.\w+)+")


@functools.cache
def string_refs(path: Path) -> list[tuple[str, int]]:
    """Every memlab module named in a string annotation of ``path`` (an argument's, a return's,
    an annotated assignment's) or in the type of a ``cast("...", x)``: (name, line). mypy
    resolves such a name, so it is an edge of the import graph even without a statement."""
    out = []
    for node in ast.walk(parsed(path)):
        types: list[ast.expr | None] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            types = [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                            args.vararg, args.kwarg) if a is not None]
            types.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            types = [node.annotation]
        elif isinstance(node, ast.Call) and node.args and (
                (isinstance(node.func, ast.Name) and node.func.id == "cast")
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "cast")):
            types = [node.args[0]]
        for t in types:
            for sub in ast.walk(t) if t is not None else ():
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    out += [(m.group(0), sub.lineno) for m in _DOTTED.finditer(sub.value)]
    return out


def full_graph() -> dict[str, list[tuple[str, int, str]]]:
    """Every edge of every module: (imported module, line, how: ``runs`` (an import statement
    that runs, at module level or in a function), ``annotations`` (under ``if TYPE_CHECKING:``)
    or ``string`` (named in a string annotation))."""
    out = {}
    for p in sorted(SRC.rglob("*.py")):
        out[module_name(p)] = ([(d, line, "runs") for d, line, _ in imports(p)]
                               + [(d, line, "annotations") for d, line, _ in
                                  imports(p, type_only=True)]
                               + [(d, line, "string") for d, line in string_refs(p)])
    return out


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


def _cycle_path(comp: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One cycle through the strongly connected ``comp``: its first module, the shortest way
    back to it (breadth first), inside ``comp``."""
    inside, start = set(comp), comp[0]
    parent: dict[str, str] = {}
    queue = [start]
    for v in queue:
        for w in sorted(edges.get(v, ())):
            if w not in inside:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")  # a component of one node has none


def test_no_import_cycle_between_modules():
    """No module reaches itself through the import graph, the imports made for annotations
    only and the modules named in string annotations included (module docstring); a cycle is
    printed module by module, each step with its line and how it imports."""
    g = full_graph()
    modules = set(g)
    how: dict[tuple[str, str], str] = {}
    edges: dict[str, set[str]] = {}
    for m, deps in g.items():
        for d, line, kind in deps:
            r = _resolve(d, modules)
            if r != m:
                edges.setdefault(m, set()).add(r)
                how.setdefault((m, r), f"line {line}, {kind}")
    found = []
    for comp in _cycles(edges):
        path = _cycle_path(comp, edges)
        steps = [f"{a} -> {b} ({how[a, b]})" for a, b in zip(path, path[1:])]
        found.append(f"{', '.join(comp)}; one way round:\n    " + "\n    ".join(steps))
    assert not found, "import cycles:\n  " + "\n  ".join(found)


def test_technique_packages_import_each_other_one_way():
    edges: dict[str, set[str]] = {}
    for mod, deps in full_graph().items():
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
    loop = SRC / "trainer" / "loop.py"
    assert "memlab.protocols" in {d for d, _, _ in imports(loop, type_only=True)}
    assert "memlab.protocols" not in {d for d, _, _ in imports(loop)}
    # and it makes an edge of the graph the cycle test reads, as a string annotation does
    assert ("memlab.protocols", "annotations") in {(d, k) for d, _, k in
                                                   full_graph()["memlab.trainer.loop"]}
    with pytest.raises(AssertionError, match="no layer assigned"):
        layer("memlab.somethingnew")


def test_the_cycle_test_sees_a_cycle(tmp_path):
    """Negative control of the cycle test: a memlab module named in a string annotation or a
    cast is an edge, and a circle is found and printed step by step."""
    b = tmp_path / "b.py"
    b.write_text("from typing import cast\n\n\ndef f(x: 'memlab.a.A') -> None:\n"
                 "    cast('list[memlab.c.C]', x)\n")
    assert string_refs(b) == [("memlab.a.A", 4), ("memlab.c.C", 5)]
    edges = {"memlab.a": {"memlab.b"}, "memlab.b": {"memlab.a", "memlab.c"}}
    (comp,) = _cycles(edges)
    assert _cycle_path(comp, edges) == ["memlab.a", "memlab.b", "memlab.a"]


def test_the_contracts_and_the_context_import_no_torch():
    """``memlab.context`` and ``memlab.protocols`` name torch's types for annotations only:
    importing them (a fresh interpreter) loads neither torch nor transformers, so the command
    line starts fast and the contracts can be read anywhere."""
    code = ("import sys, memlab.context, memlab.protocols; "
            "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "", f"importing memlab.context loads {out.stdout.strip()}"


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
