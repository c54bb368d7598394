"""The ``memlab`` console script.

memlab [overrides]              same as ``python -m memlab`` (train; -m to sweep)
memlab report DIR [DIR ...]     table + plots from summaries
memlab lengths [overrides]      token-length profile of a data config
memlab estimate [overrides]     predicted peak memory, no GPU needed
memlab vllm-serve model=... [knob=value ...]   the vLLM server of generation.mode=server
"""

from __future__ import annotations

import sys

SUBCOMMANDS = {
    "report": "memlab.cli.report",
    "lengths": "memlab.cli.lengths",
    "estimate": "memlab.cli.estimate",
    "vllm-serve": "memlab.generation.vllm_server",
}


def main(argv: list[str] | None = None) -> int | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        mod = importlib.import_module(SUBCOMMANDS[argv[0]])
        code = mod.main(argv[1:])
        if argv is not None and code:
            raise SystemExit(code)
        return code
    import runpy

    # Run exactly as ``python -m memlab`` does: Hydra resolves conf/ relative to the file of a
    # __main__ task function, and relative to a package when imported by module name.
    sys.argv = [sys.argv[0], *argv]
    runpy.run_module("memlab", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    main()
