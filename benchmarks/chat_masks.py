"""Benchmark the per-row cost of exact assistant masks (``memlab.data.chat``).

Rows: ``--n`` synthetic conversations (``memlab.data.synthetic.generate_chat``, 1-3 turns,
median ~300 tokens), the shipped tokenizer. Side by side in one invocation, best of
``--repeats`` rounds, the cases interleaved in each (min and max shown):

* ``render+tokenize``: ``apply_chat_template(tokenize=True)``, no mask (the floor);
* ``markers``: ``chat.assistant_mask`` on the shipped template ({% generation %} markers: Hugging
  Face's ``return_assistant_tokens_mask``);
* ``turns``: ``chat.assistant_mask`` on the same template without markers (turn-by-turn
  renderings, one tokenization with character offsets);
* ``turns, prefix ids``: the fallback that tokenizes every prefix rendering and compares ids.

Ratios are to ``render+tokenize``. Usage: ``PYTHONPATH=src OMP_NUM_THREADS=1 python
benchmarks/chat_masks.py [--n 2000] [--repeats 3] [--out PATH] [--dry-run]`` (``--dry-run``:
every case once on 4 conversations, nothing written).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "chat_masks.json"))
    ap.add_argument("--dry-run", action="store_true",
                    help="every case once on 4 conversations; nothing timed or written")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.n, args.repeats = min(args.n, 4), 1

    from memlab.data import chat
    from memlab.data.assets import load_tokenizer
    from memlab.data.synthetic import generate_chat

    rows = [r["messages"] for r in generate_chat(args.n, seed=1)]
    marked = load_tokenizer()
    plain = load_tokenizer()
    plain.chat_template = (marked.chat_template.replace("{%- generation -%}", "")
                           .replace("{%- endgeneration -%}", ""))

    def floor():
        for m in rows:
            marked.apply_chat_template(m, tokenize=True, return_dict=True)

    def masks(tok):
        def run():
            for i, m in enumerate(rows):
                chat.assistant_mask(tok, m, i)
        return run

    def prefix_ids():
        info = chat.template_info(plain)
        for i, m in enumerate(rows):
            turns = chat._Turns(plain, info, m, i, "messages", chat.SFT_FIX)
            full = plain.apply_chat_template(m, tokenize=False)
            ks = [k for k, x in enumerate(m) if x["role"] == "assistant"]
            bounds = [(plain.apply_chat_template(m[:k], tokenize=False,
                                                 add_generation_prompt=True),
                       plain.apply_chat_template(m[: k + 1], tokenize=False)) for k in ks]
            turns._cuts_by_prefix_ids(full, bounds, ks)

    cases = [("render+tokenize", floor), ("markers", masks(marked)), ("turns", masks(plain)),
             ("turns, prefix ids", prefix_ids)]
    tokens = sum(len(marked.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"])
                 for m in rows)
    if args.dry_run:
        for name, fn in cases:
            fn()
            print(f"  [chat_masks] {name:20s} ran on {len(rows)} conversations ({tokens} tokens)")
        print("[chat_masks] dry run: 0 invalid")
        return 0
    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    for _name, fn in cases:
        fn()  # warm-up (template compile caches)
    for _ in range(args.repeats):  # interleaved: load on a shared machine hits every case alike
        for name, fn in cases:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    results = {name: {"best_s": min(t), "worst_s": max(t), "us_per_row": 1e6 * min(t) / len(rows)}
               for name, t in times.items()}
    base = results["render+tokenize"]["best_s"]
    print(f"{len(rows)} conversations, {tokens} tokens, best of {args.repeats}")
    print(f"{'case':20s} {'us/row':>9s} {'ratio':>7s} {'spread s':>14s}")
    for name, r in results.items():
        r["ratio"] = r["best_s"] / base
        print(f"{name:20s} {r['us_per_row']:9.0f} {r['ratio']:7.2f} "
              f"{r['best_s']:6.2f}-{r['worst_s']:.2f}")
    out = {"rows": len(rows), "tokens": tokens, "repeats": args.repeats,
           "machine": platform.platform(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
