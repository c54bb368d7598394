"""The ``memlab`` command line (the console script; ``python -m memlab`` is the same).

memlab [overrides]              train one run (``-m``: a sweep, one fresh process per job)
memlab -m sweep=<name>          a ready sweep shipped with memlab (``sweep=`` group)
memlab report DIR [DIR ...]     table, CSV, Markdown, plots (and HTML) from summaries
memlab lengths [overrides]      token-length profile of a data config
memlab data show [overrides]    rows as the run sees them, loss tokens marked
memlab estimate [overrides]     predicted peak memory, no GPU needed
memlab fit --budget SIZE [overrides]   the fastest configuration that fits, measured
memlab vllm-serve model=... [knob=value ...]   the vLLM server of generation.mode=server
memlab --version                memlab's version
memlab -sc install=bash         tab completion for ``memlab`` and ``python -m memlab`` (or zsh)

``mode=estimate`` / ``mode=lengths`` / ``mode=fit`` anywhere on a training command line is the same as the
subcommand (``python -m memlab mode=estimate peft=lora --budget 24GiB``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = {
    "report": "memlab.cli.report",
    "lengths": "memlab.cli.lengths",
    "data": "memlab.cli.data",
    "estimate": "memlab.cli.estimate",
    "fit": "memlab.cli.fit",
    "vllm-serve": "memlab.generation.vllm_server",
}
MODES = {"train": None, "estimate": "memlab.cli.estimate", "lengths": "memlab.cli.lengths",
         "fit": "memlab.cli.fit"}
COMPLETION_FLAGS = ("-sc", "--shell-completion")


def version() -> str:
    """``memlab <version>`` with the versions it runs on (read from package metadata)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    import memlab

    try:
        hydra = dist_version("hydra-core")
    except PackageNotFoundError:  # pragma: no cover - hydra is a dependency
        hydra = "?"
    return f"memlab {memlab.__version__} (Hydra {hydra}, Python {sys.version.split()[0]})"


def dispatch(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``(module of the mode's command or None for training, argv without mode=...)``; raises
    ValueError for an unknown mode."""
    modes = [a.split("=", 1)[1] for a in argv if a.startswith("mode=")]
    rest = [a for a in argv if not a.startswith("mode=")]
    mode = modes[-1] if modes else "train"
    if mode not in MODES:
        raise ValueError(f"mode={mode} is not a mode; use one of: "
                         + ", ".join(f"mode={m}" for m in MODES))
    return MODES[mode], rest


def single_run_of_a_sweep(argv: Sequence[str]) -> str | None:
    """The error for ``memlab sweep=<name>`` without ``-m`` (it would train one job of the
    sweep's base config, not the sweep); None when ``argv`` sweeps or only inspects."""
    sweeps = [a for a in argv if a.split("=", 1)[0].lstrip("+") == "sweep" and "=" in a]
    inspect = {"-m", "--multirun", "--cfg", "-c", "--info", "-i", "--help", "-h",
               "--hydra-help", *COMPLETION_FLAGS}
    if not sweeps or any(a in inspect or a.startswith("--cfg=") for a in argv):
        return None
    return (f"{sweeps[-1]} is a sweep: run it with -m (memlab -m {' '.join(argv)}), or see "
            f"its config with --cfg job")


def completion_request(argv: Sequence[str]) -> tuple[str, str] | None:
    """``("install" | "uninstall", shell)`` when ``argv`` asks to install or remove tab
    completion for bash or zsh; None otherwise (queries and other shells go to Hydra)."""
    for i, arg in enumerate(argv[:-1]):
        if arg in COMPLETION_FLAGS:
            action, _, shell = argv[i + 1].partition("=")
            if action in ("install", "uninstall") and shell in ("bash", "zsh"):
                return action, shell
    return None


COMPLETION_SCRIPT = r"""# memlab tab completion (bash; zsh through bashcompinit): `memlab ...` and `python -m memlab
# ...` complete Hydra's groups, options and keys (memlab -sc query=bash answers), and memlab's
# subcommands; `memlab report` completes paths.
_memlab_completion()
{
    local line="${COMP_LINE:0:$COMP_POINT}"
    local -a words
    read -r -a words <<< "$line"
    [[ "$line" =~ [[:space:]]$ ]] && words+=("")
    local -a helper
    local first=1
    if [[ "${words[1]}" == "-m" && "${words[2]}" == "memlab" ]]; then
        helper=("${words[0]}" -m memlab); first=3
    elif [[ "${words[0]##*/}" == "memlab" ]]; then
        helper=("${words[0]}")
    else
        return 0
    fi
    local -a args=("${words[@]:$first}")
    local n=${#args[@]}
    local word="${args[n-1]}"
    local sub="" extra=""
    if (( n == 1 )); then
        extra="@SUBCOMMANDS@"
    elif [[ " @SUBCOMMANDS@ " == *" ${args[0]} "* ]]; then
        sub="${args[0]}"; args=("${args[@]:1}")
    fi
    if [[ "$sub" == "report" || "$word" == -* ]]; then
        COMPREPLY=($(compgen -f -- "$word")); return 0
    fi
    local choices
    choices=$(COMP_LINE="memlab ${args[*]}" COMP_POINT=0 "${helper[@]}" -sc query=bash 2>/dev/null)
    local cur="${COMP_WORDS[COMP_CWORD]}"
    local prefix="${word%"$cur"}"
    local c
    COMPREPLY=()
    for c in $extra $choices; do
        [[ "$c" == "$word"* ]] && COMPREPLY+=("${c#"$prefix"}")
    done
    return 0
}
complete -o nospace -o default -F _memlab_completion memlab
complete -o nospace -o default -F _memlab_completion python python3
"""


def completion_script(action: str, shell: str) -> str:
    """The shell code that installs (or removes) memlab's completion."""
    if action == "uninstall":
        return ("complete -r memlab 2>/dev/null; complete -r python python3 2>/dev/null; "
                "unset -f _memlab_completion")
    head = "autoload -Uz bashcompinit && bashcompinit\n" if shell == "zsh" else ""
    return head + COMPLETION_SCRIPT.replace("@SUBCOMMANDS@", " ".join(SUBCOMMANDS))


def main(argv: Sequence[str] | None = None, prog: str = "memlab") -> int:
    """Dispatch ``memlab`` / ``python -m memlab``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        code = importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
        return int(code or 0)
    if "--version" in argv:
        print(version())
        return 0
    request = completion_request(argv)
    if request is not None:
        print(completion_script(*request))
        return 0
    try:
        module, rest = dispatch(argv)
    except ValueError as e:
        print(f"memlab: {e}", file=sys.stderr)
        return 2
    if module is not None:
        return int(importlib.import_module(module).main(rest) or 0)
    err = single_run_of_a_sweep(rest)
    if err:
        print(f"memlab: {err}", file=sys.stderr)
        return 2
    from memlab.config import moved_overrides

    moved = moved_overrides(rest)
    if moved:
        print("\n".join(f"memlab: {m}" for m in moved), file=sys.stderr)
        return 2
    from memlab.cli.overrides import command_line_error

    err = command_line_error(rest)
    if err:
        print(f"memlab: {err}", file=sys.stderr)
        return 2
    from memlab.cli.app import main as app

    sys.argv = [prog if sys.argv[0] in ("", "-c") else sys.argv[0], *rest]
    app()
    # a sweep through memlab's launcher: 1 when a job failed or was killed (a single run exits
    # with its own status inside app())
    from hydra_plugins.memlab_launcher.memlab_launcher import sweep_exit_status

    return sweep_exit_status()


if __name__ == "__main__":
    sys.exit(main())
