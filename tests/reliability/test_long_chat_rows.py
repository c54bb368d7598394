"""Issue 43, item 6, for conversations and preference rows: one very long row prepares in bounded
memory where the method truncates, and is refused naming file, line and field where every token
is kept.

Conversations and conversational preference rows far longer than the method keeps are cut before
tokenizing to the same kept ids and masks (:mod:`memlab.data.chat_cut`; their equality is tested
in tests/unit/data/test_chat_cut.py and tests/unit/method/test_cut_rows.py); here, the memory of
one 100 MB row, and the refusal where packing keeps every token.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memlab.data import cut
from memlab.data.base import DataError
from reliability.helpers import ENV

pytestmark = [pytest.mark.integration]

MB = 100
PREPARE_MIB = 700
"""What ``method=dpo``'s prepare may add to the process's memory for one conversational row of
:data:`MB` million characters (50 M in the prompt, 50 M in the chosen answer), measured: 353 MiB
(the row as Python strings, its whole renderings as text); tokenized whole, ~230 bytes a
character: ~23 GB."""


def test_a_100_mb_conversation_prepares_in_bounded_memory():
    """The peak is the process's own memory's high-water mark (VmHWM), reset after the dataset
    is built (``/proc/self/clear_refs``), so it is the prepare's alone."""
    script = textwrap.dedent(f"""
        import json
        import datasets
        from memlab.data.assets import load_tokenizer
        from memlab.method.dpo import DPO

        def status(key):
            return [int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                    if line.startswith(key)][0]

        chunk = "alpha beta gamma, delta. 42 eta\\n" * 1000
        big = chunk * ({MB} * 10**6 // 2 // len(chunk))
        ds = datasets.Dataset.from_list([
            {{"prompt": [{{"role": "user", "content": big}}],
              "chosen": [{{"role": "assistant", "content": big}}],
              "rejected": [{{"role": "assistant", "content": "no"}}]}},
            {{"prompt": [{{"role": "user", "content": "hi"}}],
              "chosen": [{{"role": "assistant", "content": "yes"}}],
              "rejected": [{{"role": "assistant", "content": "no"}}]}}])
        del big
        tok = load_tokenizer()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status("VmRSS:")
        out, stats = DPO().prepare(ds, tok, None)
        print(json.dumps({{"added": status("VmHWM:") - before, "extra": stats.extra,
                          "lens": [[len(x) for x in out[c]] for c in
                                   ("prompt_ids", "chosen_ids", "rejected_ids")]}}))
    """)
    tests = Path(__file__).parents[1]
    env = {**ENV, "PYTHONPATH": f"{tests}:{ENV.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", script], env=env, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    result = json.loads(out.strip().splitlines()[-1])
    # max_prompt_length=512, the chosen answer cut to max_length=1024 less the prompt
    assert result["lens"] == [[512, 10], [512, 4], [4, 4]]
    assert result["extra"]["cut_before_tokenizing"]["characters"] > 0.99 * MB * 10**6
    assert result["added"] < PREPARE_MIB * 2**20, f"{result['added'] / 2**20:.0f} MiB"


def _prepare(tmp_path: Path, rows: list[dict], *overrides: str):
    from omegaconf import OmegaConf

    from memlab.context import validate
    from memlab.pipeline import prepare_rows
    from memlab_testing import compose, with_fast

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = OmegaConf.to_container(compose(with_fast(["data=local", f"data.path={path}",
                                                    *overrides])))
    del cfg["hydra"]
    ctx = validate(OmegaConf.create(cfg))
    return prepare_rows(ctx, ctx.model.load_tokenizer(ctx))[1:3]


def test_a_conversation_kept_whole_is_refused_naming_file_and_line(tmp_path, monkeypatch):
    """Packing that keeps every token (and a method without limits) tokenizes a conversation
    whole: over the limit (lowered here) it is ``invalid``, naming file, line, field and size;
    the same row under a truncating method is cut and prepared."""
    monkeypatch.setattr(cut, "WHOLE_LIMIT", 20_000)
    monkeypatch.setattr(cut, "SEARCH", 1024)
    big = "word " * 5_000
    chat_row = {"messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": big}]}
    pair = {"prompt": [{"role": "user", "content": big}],
            "chosen": [{"role": "assistant", "content": "a"}],
            "rejected": [{"role": "assistant", "content": "b"}]}
    small = {"messages": chat_row["messages"][:1] + [{"role": "assistant", "content": "ok"}]}
    cases = [([small, chat_row], ["method=sft", "packing=bfd_split"],
              "line 2: row 1: field 'messages'", "packing=bfd_split keeps every token"),
             ([pair], ["method=dpo", "method.max_length=null", "method.max_prompt_length=null"],
              "line 1: row 0: field 'prompt'", "the method keeps every token of it")]
    for rows, overrides, where, why in cases:
        with pytest.raises(DataError) as e:
            _prepare(tmp_path, rows, *overrides)
        msg = str(e.value)
        assert "rows.jsonl" in msg and where in msg and why in msg, msg
        assert "over the 20,000" in msg and "split it into several rows" in msg
    ds, stats = _prepare(tmp_path, [small, chat_row], "method=sft")
    assert len(ds) == 2 and stats.extra["cut_before_tokenizing"]["rows"] == 1
