"""Write summary.json's JSON Schema into the package: ``python scripts/gen_summary_schema.py``.

The schema is made from the typed definition (:mod:`memlab.measure.schema`) and shipped as
``src/memlab/assets/summary.schema.json``; ``tests/unit/measure/test_summary_schema.py`` fails
while the shipped file differs from what this writes. ``--check``: write nothing, exit 1 when
the shipped file is stale.
"""

from __future__ import annotations

import argparse
import sys

from memlab.measure.schema import SCHEMA_PATH, schema_text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when the shipped schema is stale; write nothing")
    args = parser.parse_args(argv)
    text = schema_text()
    current = SCHEMA_PATH.read_text(encoding="utf-8") if SCHEMA_PATH.is_file() else None
    if args.check:
        if current != text:
            print(f"{SCHEMA_PATH} is stale: run python scripts/gen_summary_schema.py",
                  file=sys.stderr)
            return 1
        return 0
    if current != text:
        SCHEMA_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {SCHEMA_PATH}")
    else:
        print(f"{SCHEMA_PATH} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
