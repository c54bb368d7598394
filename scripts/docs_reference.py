"""The generated part of memlab's docs, and the mkdocs hook that puts it in (``mkdocs.yml``:
``hooks: [scripts/docs_reference.py]``). Nothing here is committed as Markdown: every build reads
the code.

- ``<!-- memlab:options GROUP -->`` in a page becomes the reference of every registered option of
  that group (``memlab.registry``): for each option its module's docstring, and a table of its
  fields: key, type, default (the option's yaml where it sets one, else the dataclass default),
  range (the ``Range`` in the annotation) and help (the field's attribute docstring, read from
  the source with ``ast``; where a field has none, the comment beside its key in the yaml). ``<!-- memlab:options train -->`` / ``measure`` do the same for the
  top-level ``TrainConfig`` / ``MeasureConfig`` against ``config.yaml``.
- ``<!-- memlab:flags COMMAND -->`` becomes the flags of ``memlab COMMAND`` (estimate, fit,
  report, lengths), read from the command's own ``build_parser()``.
- ``<!-- memlab:docstring memlab.MODULE -->`` becomes that module's docstring (the pipeline's
  order, the run's endings), so the page says what the code says.
- ``<!-- memlab:tests FOLDER -->`` lists what the tests under ``tests/FOLDER`` check (each
  file's docstring and its tests' names).
- ``<!-- memlab:modules -->``: every module and package of ``src/memlab`` with its docstring.
- ``<!-- memlab:groups -->``, ``<!-- memlab:sweeps -->``, ``<!-- memlab:experiments -->``: the
  groups and their options, the ready sweeps and what each varies, the shipped experiments;
  all read through Hydra's config loader, so they follow the configs wherever they live.
- ``<!-- memlab:summary -->``: summary.json's record, every object and key with its type and
  docstring, and what each status must hold (:func:`memlab.measure.schema.reference`).
- ``<!-- memlab:gpu_acceptance -->``: the "verified on" table of the GPU paths: every case of
  ``benchmarks/gpu_acceptance.py`` with its result in ``benchmarks/results/gpu_acceptance.json``
  ("not run" where that file has none) and the machine it ran on.
- ``experiments/*/README.md`` (with their plots and report tables) and ``benchmarks/README.md``
  are added to the site as they are in the repository.

The build fails (mkdocs ``--strict`` or not) on an unknown marker, and when a group or a command
has no page with its marker: a new group cannot be left out of the docs silently.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.resources
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ("estimate", "fit", "report", "lengths", "data")
"""Subcommands whose flags the docs list (each module has ``build_parser()``)."""
TOPLEVEL = ("train", "measure")
"""Top-level config nodes with a typed config of their own (``memlab.config``)."""
MARKER = re.compile(r"<!--\s*memlab:(\w+)(?:\s+([\w.-]+))?\s*-->")


# ---------------------------------------------------------------- reading the typed configs

def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal right below ``name: type = ...``),
    from ``cls`` and its bases (a subclass's own wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or klass.__module__ == "builtins":
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        tree = ast.parse(source)
        node = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
        if node is None:
            continue
        body = node.body
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def rst_to_md(text: str) -> str:
    """Docstring markup to Markdown: ``x`` and :role:`x` to `x`."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def one_line(text: str) -> str:
    """A docstring as one table cell (paragraphs joined, pipes escaped, also in code)."""
    parts = re.split(r"(`[^`]*`)", " ".join(rst_to_md(text).split()))
    return "".join(code_cell(p[1:-1]) if p.startswith("`") and len(p) > 1
                   else p.replace("|", "\\|") for p in parts)


def type_text(tp: Any) -> str:
    """An annotation as a reader writes it: ``int``, ``'a' | 'b'``, ``float | None``."""
    origin = get_origin(tp)
    if origin is Annotated:
        return type_text(get_args(tp)[0])
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_text(a) for a in get_args(tp))
    if tp is type(None):
        return "None"
    if tp is Any:
        return "any"
    if origin is not None:
        args = ", ".join(type_text(a) for a in get_args(tp))
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{args}]" if args else name
    return getattr(tp, "__name__", str(tp))


def yaml_value(value: Any) -> str:
    """A value as it is written in yaml or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


MISSING = object()


def yaml_comments(text: str, under: str | None = None) -> dict[str, str]:
    """The comment beside each key of a yaml text (top-level keys, or the keys of ``under:``)."""
    out: dict[str, str] = {}
    inside = under is None
    for line in text.splitlines():
        m = re.match(r"^(\s*)([A-Za-z_]\w*):[^#]*#\s*(.*)$", line) or re.match(
            r"^(\s*)([A-Za-z_]\w*):", line)
        if m is None:
            continue
        top = not m[1]
        if under is not None and top:
            inside = m[2] == under
            continue
        if inside and (top if under is None else len(m[1]) == 2) and m.lastindex == 3:
            out[m[2]] = m[3]
    return out


def field_rows(cls: type, node: dict[str, Any] | None,
               comments: dict[str, str] | None = None) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, range, help) of every init field of ``cls``; the default is the
    yaml's where ``node`` (the option's yaml) sets the key, else the dataclass's; the help is
    the field's docstring, else the comment beside the key in the yaml (``comments``)."""
    from memlab.registry import numeric_knobs

    hints = typing.get_type_hints(cls, include_extras=True)
    ranges = numeric_knobs(cls)
    docs = field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        value: Any = MISSING
        if node is not None and f.name in node:
            value = node[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            value = f.default_factory()  # type: ignore[misc]
        default = ("required" if value is MISSING or value == "???"
                   else code_cell(yaml_value(value)))
        rng = ranges.get(f.name)
        rows.append((f"`{f.name}`", code_cell(type_text(hints[f.name])),
                     default, rng.describe() if rng else "",
                     one_line(docs.get(f.name) or (comments or {}).get(f.name, ""))))
    return rows


def code_cell(text: str) -> str:
    """``text`` in code spans, split at its ``|`` (a table cell cannot hold one in code)."""
    return " \\| ".join(f"`{part.strip()}`" for part in text.split("|"))


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


FIELD_HEADER = ("key", "type", "default", "range", "help")


# ---------------------------------------------------------------- memlab's configs (Hydra)

class Configs:
    """memlab's config tree as Hydra sees it (``conf/``, ``sweeps/`` and its search path)."""

    def __init__(self) -> None:
        from hydra.core.global_hydra import GlobalHydra

        from memlab.cli.compose import initialize

        GlobalHydra.instance().clear()
        with initialize():
            self.loader = GlobalHydra.instance().config_loader()
            self._cache: dict[str, Any] = {}

    def node(self, path: str) -> Any:
        """The raw config at ``path`` (``method/dpo``), its defaults list and header, or None."""
        if path not in self._cache:
            self._cache[path] = self.loader.repository.load_config(path)
        return self._cache[path]

    def options(self, group: str) -> list[str]:
        return sorted(self.loader.get_group_options(group))

    def text(self, path: str) -> str:
        """The yaml text of ``path`` (for its comments), from whichever source holds it."""
        for source in self.loader.get_sources():
            if not source.is_config(path):
                continue
            if source.scheme() == "pkg":
                return (importlib.resources.files(source.path) / f"{path}.yaml").read_text()
            if source.scheme() == "file":
                return (Path(source.path) / f"{path}.yaml").read_text()
        return ""

    def header(self, path: str) -> str:
        """The first comment paragraph of a yaml (after ``# @package``), as one line."""
        lines = []
        for line in self.text(path).splitlines():
            if not line.startswith("#"):
                break
            body = line[1:].strip()
            if body.startswith("@package"):
                continue
            if not body or body.startswith(("memlab ", "python -m memlab")):
                if lines:
                    break
                continue
            lines.append(body)
        return " ".join(lines).rstrip(":")


def plain(node: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=False) if node is not None else None


def flatten(d: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


# ---------------------------------------------------------------- the generated sections

def options_reference(group: str, configs: Configs) -> str:
    """Every registered option of ``group``: its module docstring and its fields."""
    from memlab import registry

    if group in TOPLEVEL:
        from memlab import config

        cls = {"train": config.TrainConfig, "measure": config.MeasureConfig}[group]
        top = plain(configs.node("config").config) or {}
        doc = one_line(inspect.getdoc(cls) or "")
        comments = yaml_comments(configs.text("config"), under=group)
        return f"{doc}\n\n" + table(FIELD_HEADER, field_rows(cls, top.get(group), comments))
    out = []
    for name in registry.options(group):
        cls = registry.lookup(group, name)
        result = configs.node(f"{group}/{name}")
        node = plain(result.config) if result is not None else None
        module = sys.modules[cls.__module__]
        doc = inspect.cleandoc(module.__doc__ or cls.__doc__ or "")
        summary, _, rest = doc.partition("\n\n")
        out.append(f"### `{group}={name}`\n")
        out.append(rst_to_md(summary))
        if rest.strip():
            body = textwrap.indent(rst_to_md(rest.strip()), "    ")
            out.append(f'\n??? note "More on `{group}={name}`"\n\n{body}')
        where = f"`{cls.__module__}.{cls.__qualname__}`"
        if result is None:
            where += f"; no `{group}/{name}.yaml` (registered only)"
        out.append(f"\nConfig class {where}.\n")
        comments = yaml_comments(configs.text(f"{group}/{name}")) if result else {}
        out.append(table(FIELD_HEADER, field_rows(cls, node, comments)) if dataclasses.fields(cls)
                   else "No knobs.")
        out.append("")
    return "\n".join(out)


def _parser(command: str):
    return importlib.import_module(f"memlab.cli.{command}").build_parser()


def flags_reference(command: str) -> str:
    """The flags and arguments of ``memlab COMMAND``, from its own argparse parser (a command
    with subcommands, such as ``memlab data show``: each subcommand's)."""
    parser = _parser(command)
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if subs:
        return "\n\n".join(f"### `memlab {command} {name}`\n\n" + parser_reference(sub)
                           for name, sub in subs[0].choices.items())
    return parser_reference(parser)


def parser_reference(parser: argparse.ArgumentParser) -> str:
    """One argparse parser's usage, flags (spelling, default, choices, help) and epilog."""
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if action.help == "==SUPPRESS==" or action.dest == "help":
            continue
        if action.option_strings:
            spelling = ", ".join(action.option_strings)
            if action.nargs != 0:
                metavar = action.metavar or (
                    "{" + ",".join(map(str, action.choices)) + "}" if action.choices
                    else action.dest.upper())
                spelling += f" {metavar}"
        else:
            spelling = (action.metavar or action.dest) + (" ..." if action.nargs == "+" else "")
        choices = ", ".join(map(str, action.choices)) if action.choices else ""
        default = "" if action.default in (None, False, [], "==SUPPRESS==") or action.nargs == 0 \
            else f"`{action.default}`"
        help_text = formatter._expand_help(action) if action.help else ""
        rows.append((f"`{spelling}`", default, choices, one_line(help_text)))
    usage = parser.format_usage().strip()
    desc = one_line(parser.description or "")
    epilog = one_line(parser.epilog or "")
    parts = [desc, f"```text\n{usage}\n```", table(("flag", "default", "choices", "help"), rows)]
    if epilog:
        parts.append(epilog)
    return "\n\n".join(p for p in parts if p)


def groups_overview(configs: Configs) -> str:
    """Each group, its default (``config.yaml``'s defaults list), its options, its modules."""
    from memlab import registry

    main = configs.node("config")
    defaults = {d.group: d.value for d in (main.defaults_list or [])
                if getattr(d, "group", None)}
    rows = []
    for group in registry.GROUPS:
        names = registry.options(group)
        rows.append((f"[`{group}`]({group}.md)", f"`{defaults.get(group, '')}`",
                     ", ".join(f"`{n}`" for n in names), f"`src/memlab/{group}/`"))
    return table(("group", "default", "options", "modules"), rows)


def sweeps_reference(configs: Configs) -> str:
    """The ready sweeps: what each is for, what it varies, what it fixes."""
    rows = []
    for name in configs.options("sweep"):
        node = plain(configs.node(f"sweep/{name}").config) or {}
        params = (node.get("hydra") or {}).get("sweeper", {}).get("params", {})
        varies = "<br>".join(f"`{k}={yaml_value(v)}`" for k, v in params.items())
        fixed = {k: v for k, v in node.items() if k != "hydra"}
        sets = "<br>".join(f"`{k}={yaml_value(v)}`" for k, v in flatten(fixed))
        rows.append((f"`{name}`", one_line(configs.header(f"sweep/{name}")), varies, sets))
    return table(("sweep", "what it is for", "varies", "sets"), rows)


def experiments_reference(configs: Configs) -> str:
    """The shipped experiments: what each is, the groups it picks."""
    rows = []
    for name in configs.options("experiment"):
        result = configs.node(f"experiment/{name}")
        picks = [f"`{d.group.lstrip('/')}={d.value}`"
                 for d in (result.defaults_list or []) if getattr(d, "group", None)]
        rows.append((f"`{name}`", one_line(configs.header(f"experiment/{name}")),
                     " ".join(picks)))
    return table(("experiment", "what it is", "groups"), rows)


def tests_reference(folder: str) -> str:
    """What the tests under ``tests/<folder>`` check: each file's docstring and its tests'
    names (read with ``ast``; nothing imported or run)."""
    out = []
    for path in sorted((REPO / "tests" / folder).glob("test_*.py")):
        tree = ast.parse(path.read_text())
        names = [n.name.removeprefix("test_").replace("_", " ") for n in tree.body
                 if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        out.append(f"**`tests/{folder}/{path.name}`**: {one_line(ast.get_docstring(tree) or '')}"
                   "\n")
        out += [f"- {n}" for n in names]
        out.append("")
    return "\n".join(out)


def modules_reference() -> str:
    """Every module and package directly under ``src/memlab``: the first paragraph of its
    docstring (read with ``ast``)."""
    import memlab

    root = Path(memlab.__file__).parent
    rows = []
    for path in sorted(root.iterdir()):
        source = path / "__init__.py" if path.is_dir() else path
        if not source.is_file() or source.suffix != ".py" or path.name.startswith("__pycache"):
            continue
        doc = ast.get_docstring(ast.parse(source.read_text())) or ""
        name = f"`{path.name}/`" if path.is_dir() else f"`{path.name}`"
        rows.append((name, one_line(doc.split("\n\n")[0])))
    return table(("src/memlab/", "what it is (its docstring)"), rows)


def gpu_acceptance_table() -> str:
    """Every case of benchmarks/gpu_acceptance.py and its result (module docstring)."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location(
        "memlab_gpu_acceptance", REPO / "benchmarks" / "gpu_acceptance.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    path = REPO / "benchmarks" / "results" / "gpu_acceptance.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    env = result.get("environment") or {}
    where = (f"{env.get('gpu')}, driver {env.get('driver')}, CUDA {env.get('cuda')}, torch "
             f"{env.get('torch')} ({result.get('date')})" if env else "")
    got = {(r["piece"], r["case"]): r for r in result.get("rows", [])}
    rows = []
    for piece in module.PIECES:
        for case in piece.cases or (module.Case(piece.name, (), piece.what),):
            r = got.get((piece.name, case.name))
            checks = "; ".join(f"{c['check']}: {'ok' if c['passed'] else 'failed'}"
                               for c in (r or {}).get("checks", []))
            rows.append((piece.name, case.name, one_line(case.what or piece.what),
                         one_line(r["status"]) if r else "not run", checks,
                         where if r else ""))
    return table(("piece", "case", "what", "result", "checks", "verified on"), rows)


def render(kind: str, arg: str | None, configs: Configs) -> str:
    """The Markdown of one marker; ValueError for an unknown one."""
    from memlab import registry

    if kind == "options" and arg in (*registry.GROUPS, *TOPLEVEL):
        return options_reference(arg, configs)
    if kind == "flags" and arg in COMMANDS:
        return flags_reference(arg)
    if kind == "docstring" and arg is not None and arg.startswith("memlab."):
        return rst_to_md(inspect.cleandoc(importlib.import_module(arg).__doc__ or ""))
    if kind == "tests" and arg is not None and (REPO / "tests" / arg).is_dir():
        return tests_reference(arg)
    if kind == "modules" and arg is None:
        return modules_reference()
    if kind == "groups" and arg is None:
        return groups_overview(configs)
    if kind == "sweeps" and arg is None:
        return sweeps_reference(configs)
    if kind == "experiments" and arg is None:
        return experiments_reference(configs)
    if kind == "gpu_acceptance" and arg is None:
        return gpu_acceptance_table()
    if kind == "summary" and arg is None:
        from memlab.measure.schema import reference

        return reference()
    raise ValueError(f"unknown docs marker memlab:{kind} {arg or ''}".strip())


def expand(markdown: str, configs: Configs, seen: set[str] | None = None) -> str:
    """``markdown`` with every marker replaced; ``seen`` collects ``kind:arg`` of each."""
    def sub(m: re.Match) -> str:
        if seen is not None:
            seen.add(f"{m.group(1)}:{m.group(2)}")
        return render(m.group(1), m.group(2), configs)

    return MARKER.sub(sub, markdown)


def required_markers() -> set[str]:
    """The markers some page must hold: every group, train, measure and every command."""
    from memlab import registry

    return ({f"options:{g}" for g in (*registry.GROUPS, *TOPLEVEL)}
            | {f"flags:{c}" for c in COMMANDS} | {"summary:None"})


# ---------------------------------------------------------------- the mkdocs hook

_STATE: dict[str, Any] = {}


def on_files(files, config):
    """Add the experiments' write-ups (with their plots and tables) and benchmarks/README.md."""
    from mkdocs.structure.files import File

    _STATE["configs"] = Configs()
    _STATE["seen"] = set()
    for path in sorted((REPO / "experiments").glob("*/*")):
        if path.is_file() and path.suffix in (".md", ".png"):
            uri = f"experiments/{path.parent.name}/{path.name}"
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    files.append(File.generated(config, "benchmarks.md",
                                abs_src_path=str(REPO / "benchmarks" / "README.md")))
    return files


def on_config(config):
    """The experiments' write-ups in the navigation (by folder name: date, then question)."""
    nav = config.get("nav") or []
    for entry in nav:
        if isinstance(entry, dict) and "Experiments" in entry:
            pages = entry["Experiments"]
            pages += [{p.parent.name: f"experiments/{p.parent.name}/README.md"}
                      for p in sorted((REPO / "experiments").glob("*/README.md"))]
    return config


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "experiments/index.md":
        _STATE["experiments_index"] = markdown
    return expand(markdown, _STATE["configs"], _STATE["seen"])


def on_post_build(config):
    from mkdocs.exceptions import PluginError

    problems = []
    missing = sorted(required_markers() - _STATE["seen"])
    if missing:
        problems.append("no page holds the generated reference of " + ", ".join(missing)
                        + " (add <!-- memlab:KIND ARG --> to a page)")
    index = _STATE.get("experiments_index", "")
    unlisted = [p.parent.name for p in sorted((REPO / "experiments").glob("*/README.md"))
                if f"({p.parent.name}/README.md)" not in index]
    if unlisted:
        problems.append("docs/experiments/index.md does not link "
                        + ", ".join(f"{n}/README.md" for n in unlisted))
    if problems:
        raise PluginError("docs: " + "; ".join(problems))
