"""``memlab report --html`` in a real browser (headless Chromium driven by Playwright): a sweep
of three settings with a baseline shows its whole table in a 1,280 px window, no sideways
scrolling, every column shown; a wide sweep's page fits the window too, every column of its
table can be scrolled into view inside the table's box (none hidden, none under the pinned job
column), every image decodes, and the page logs no error; the table sorts by any column (a click
on its name) and filters by any column (text typed in), a hostile setting shown, never run. The
screenshots are kept under the tests' tmp dirs (their paths are printed).

Needs Debian's ``chromium`` (``scripts/setup.sh`` installs it where it runs as root with apt) and
the ``playwright`` package (the dev extra); skipped otherwise, with the line that installs them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from memlab.cli.report import main

INSTALL = ("apt-get update && apt-get install -y chromium (as root), and "
           "pip install playwright (memlab's dev extra); no `playwright install` download needed")
WIDTH = 1280


def _chromium() -> str:
    pytest.importorskip("playwright.sync_api", reason=f"no playwright: {INSTALL}")
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip(f"no chromium browser: {INSTALL}")
    return found


def _wide_sweep(root: Path) -> Path:
    """Twelve jobs that vary sixteen settings, one of them invalid with a long reason and one out
    of memory: a table wider than the window, and every plot."""
    import json

    sweep = root / "multirun" / "wide"
    mib = 2**20
    for num in range(12):
        status = {5: "invalid", 9: "oom"}.get(num, "ok")
        overrides = [f"peft={('none', 'lora')[num % 2]}",
                     f"train.gradient_checkpointing={('true', 'false')[num // 6]}",
                     f"method.max_length={256 * (1 + num % 3)}",
                     f"train.batch_size={1 + num % 4}",
                     f"attention.implementation_with_a_long_name=value_{num % 2}",
                     f"data.path=/data/sets/chat_conversations_{num % 3}.jsonl",
                     *(f"method.knob_number_{k}={1000 * k + num % 2}" for k in range(10))]
        s: dict = {"status": status, "overrides": overrides, "choices": {"method": "sft"},
                   "job": {"num": num}, "memory": None, "throughput": None, "train": None,
                   "error": {"invalid": "invalid configuration (2 problem(s)):\n- " + "x" * 90
                             + "\n- method.max_length must be >= 2",
                             "oom": "CUDA out of memory"}.get(status)}
        if status == "ok":
            peak = (50 + 7 * num) * mib
            cats = {"parameters": peak // 10, "gradients": peak // 10, "optimizer": peak // 5,
                    "activations": peak // 2}
            cats["other"] = peak - sum(cats.values())
            s["memory"] = {"peak_bytes": peak, "by_category": cats,
                           "by_phase": {"forward": peak // 2, "backward": peak,
                                        "optimizer": peak // 3, "eval": peak // 4}}
            s["throughput"] = {"tokens_per_s": 400.0 + 37 * (num % 5),
                               "tokens_per_s_std": 9.0 * (1 + num % 3), "timed_steps": 6}
            s["train"] = {"final_loss": 2.5 - num / 20, "loss_curve": [3.0, 2.5 - num / 20]}
            s["eval"] = {"final": {"step": 10, "loss": 2.0 + num / 10}}
        job = sweep / str(num)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        (job / "summary.json").write_text(json.dumps(s))
    return sweep


@pytest.mark.slow
def test_the_html_report_fits_a_1280px_window_in_a_real_browser(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    chromium = _chromium()
    sweep = _wide_sweep(tmp_path)
    out = tmp_path / "report"
    assert main([str(sweep), "--out", str(out), "--html", "--baseline", "0",
                 "--budget", "100MiB"]) == 0
    errors: list[str] = []
    shot = tmp_path / "report_page.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto((out / "report.html").as_uri())
            page.wait_for_load_state("load")
            # the page itself never scrolls sideways
            assert page.evaluate("document.documentElement.scrollWidth") <= WIDTH
            box = page.locator(".table-box")
            wide = box.evaluate("b => [b.scrollWidth, b.clientWidth, "
                                "getComputedStyle(b).overflowX]")
            assert wide[0] > wide[1] + 100 and wide[2] in ("auto", "scroll"), wide
            headers = page.evaluate("() => [...document.querySelectorAll('th')]"
                                    ".map(th => th.dataset.col)")
            assert {"job", "peak_MiB", "tokens_per_s", "eval_loss", "pareto"} <= set(headers)
            for i, name in enumerate(headers):  # each column scrolled into view in its box
                seen = box.evaluate("""(b, i) => {
                    const th = b.querySelectorAll('th')[i];
                    th.scrollIntoView({inline: 'center', block: 'nearest'});
                    const r = th.getBoundingClientRect(), o = b.getBoundingClientRect();
                    const s = getComputedStyle(th);
                    const hit = document.elementFromPoint(r.left + r.width / 2,
                                                          r.top + r.height / 2);
                    return {inside: r.left >= o.left - 1 && r.right <= o.right + 1,
                            shown: r.width > 0 && s.display !== 'none'
                                   && s.visibility !== 'hidden',
                            top: hit === th || th.contains(hit)};
                }""", i)
                assert seen == {"inside": True, "shown": True, "top": True}, (name, seen)
            images = page.evaluate("""() => [...document.images].map(i => [i.alt,
                i.complete && i.naturalWidth > 0, i.getBoundingClientRect().right])""")
            assert len(images) == 4, images
            for alt, decoded, right in images:
                assert decoded and right <= WIDTH, (alt, decoded, right)
            box.evaluate("b => { b.scrollLeft = 0; }")
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert not errors, errors
    assert shot.stat().st_size > 10_000
    print(f"\nscreenshot of the report page: {shot}")


def _three_settings(root: Path) -> Path:
    """A sweep of three settings, 2 x 2 x 2 jobs at real sizes (GiB peaks, four-digit tokens/s,
    held-out loss), one out of memory with its reason: the cookbook's kind of question."""
    import json

    sweep = root / "multirun" / "2026-01-01" / "12-00-00"
    mib = 2**20
    for num in range(8):
        peft, gc, length = ("none", "lora")[num % 2], ("false", "true")[num // 4], \
            (2048, 4096)[(num // 2) % 2]
        overrides = [f"peft={peft}", f"train.gradient_checkpointing={gc}",
                     f"method.max_length={length}"]
        s: dict = {"status": "oom" if num == 6 else "ok", "overrides": overrides,
                   "choices": {"method": "sft", "peft": peft}, "job": {"num": num},
                   "memory": None, "throughput": None, "train": None,
                   "error": "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 23.64 GiB "
                            "total capacity; 21.90 GiB already allocated)" if num == 6 else None}
        if num != 6:
            peak = (15000 + 1234 * num) * mib
            cats = {"parameters": peak // 3, "gradients": peak // 6, "optimizer": peak // 4,
                    "activations": peak // 5}
            cats["other"] = peak - sum(cats.values())
            s["memory"] = {"peak_bytes": peak, "by_category": cats,
                           "by_phase": {"forward": peak // 2, "backward": peak,
                                        "optimizer": peak // 3, "eval": peak // 4}}
            s["throughput"] = {"tokens_per_s": 4321.5 - 123 * num,
                               "tokens_per_s_std": 12.5 * (1 + num % 3), "timed_steps": 30}
            s["data"] = {"padding_fraction": 0.125}
            s["train"] = {"final_loss": 1.5 - num / 50, "loss_curve": [2.0, 1.5 - num / 50]}
            s["eval"] = {"final": {"step": 40, "loss": 1.6 + num / 40}}
        job = sweep / str(num)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        (job / "summary.json").write_text(json.dumps(s))
    return sweep


@pytest.mark.slow
def test_three_settings_and_a_baseline_fit_1280px_without_scrolling(tmp_path: Path) -> None:
    """Issue 45 item 6: the cookbook's question, three settings varied, against a baseline
    named by several key=value pairs: the table needs no sideways scrolling at 1,280 px
    (scrollWidth <= clientWidth), every column of report.csv is on the page (each d_* change
    under the value it changes), none hidden, and the baseline's row is marked."""
    import csv

    from playwright.sync_api import sync_playwright

    chromium = _chromium()
    sweep = _three_settings(tmp_path)
    out = tmp_path / "report"
    assert main([str(sweep), "--out", str(out), "--html", "--no-plots", "--baseline",
                 "peft=none", "train.gradient_checkpointing=false", "max_length=2048"]) == 0
    with (out / "report.csv").open() as f:
        columns = next(csv.reader(f))
    assert {"d_peak_MiB", "d_tokens_per_s_pct", "eval_loss", "run_dir", "error"} <= set(columns)
    shot = tmp_path / "report_3_settings.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": 900})
            page.goto((out / "report.html").as_uri())
            page.wait_for_load_state("load")
            box = page.locator(".table-box")
            wide = box.evaluate("b => [b.scrollWidth, b.clientWidth]")
            assert wide[0] <= wide[1], f"the table scrolls sideways: {wide}"
            assert page.evaluate("document.documentElement.scrollWidth") <= WIDTH
            shown = page.evaluate("""() => {
                const o = document.querySelector('.table-box').getBoundingClientRect();
                return [...document.querySelectorAll('[data-col]')].map(e => {
                    const r = e.getBoundingClientRect(), s = getComputedStyle(e);
                    return [e.dataset.col, r.width > 0
                            && r.height > 0 && s.display !== 'none'
                            && s.visibility !== 'hidden' && r.left >= o.left - 1
                            && r.right <= o.right + 1];
                });
            }""")
            assert all(ok for _, ok in shown), [n for n, ok in shown if not ok]
            # every column once (a reason: a row under its job's, the table's width)
            assert sorted({n for n, _ in shown}) == sorted(columns)
            marked = page.locator("tr.baseline")
            assert marked.count() == 1
            assert marked.locator("td").first.inner_text().split() == ["0", "baseline"]
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    print(f"\nscreenshot of the report page: {shot}")


@pytest.mark.slow
def test_the_table_sorts_and_filters_by_any_column_in_a_real_browser(tmp_path: Path) -> None:
    """Issue 46 item 7: a click on a column's name orders the rows by it (again: the other way;
    blanks last; a job's reason stays under it; a change under a name sorts by the change);
    text typed in the filter hides the jobs without it, in any column or in the one chosen
    (``>20000``: a comparison); a hostile setting is shown, never run."""
    import json

    from playwright.sync_api import sync_playwright

    chromium = _chromium()
    sweep = _three_settings(tmp_path)
    job1 = sweep / "1" / "summary.json"
    s = json.loads(job1.read_text())
    s["overrides"].append("data.path=<script>alert(1)</script>.jsonl")
    job1.write_text(json.dumps(s))
    out = tmp_path / "report"
    assert main([str(sweep), "--out", str(out), "--html", "--no-plots", "--baseline", "0"]) == 0
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": 900})
            page.on("dialog", lambda d: (errors.append(f"dialog: {d.message}"), d.dismiss()))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto((out / "report.html").as_uri())
            page.wait_for_load_state("load")

            def jobs() -> list[str]:  # the shown jobs, top to bottom ("6+": its reason under it)
                return page.evaluate("""() => {
                    const out = [];
                    for (const tr of document.querySelectorAll('#report-table tbody tr')) {
                        if (tr.getBoundingClientRect().height === 0) continue;
                        if (tr.classList.contains('reason')) out[out.length - 1] += '+';
                        else out.push(tr.cells[0].firstChild.textContent.trim());
                    }
                    return out;
                }""")

            def sort(selector: str) -> None:
                page.click(f"#report-table thead {selector}")

            assert jobs() == ["0", "1", "2", "3", "4", "5", "7", "6+"]  # by peak, not ok last
            sort("th[data-col=tokens_per_s] > .name")
            assert jobs() == ["7", "5", "4", "3", "2", "1", "0", "6+"]  # slowest first
            assert page.get_attribute("th[data-col=tokens_per_s]", "aria-sort") == "ascending"
            sort("th[data-col=tokens_per_s] > .name")
            assert jobs() == ["0", "1", "2", "3", "4", "5", "7", "6+"]  # blanks still last
            assert page.get_attribute("th[data-col=tokens_per_s]", "aria-sort") == "descending"
            sort("th[data-col=peft] > .name")  # text: lora first, ties in the page's order
            assert jobs() == ["1", "3", "5", "7", "0", "2", "4", "6+"]
            sort("[data-sort=d_peak_pct]")  # a change under peak_MiB
            assert jobs()[:3] == ["0", "1", "2"]
            assert page.get_attribute("th[data-col=peak_MiB]", "aria-sort") == "none"

            page.fill("#filter-text", "LORA")  # any column, case aside
            assert sorted(jobs()) == ["1", "3", "5", "7"]
            assert page.inner_text("#shown-count") == "4 of 8 jobs"
            page.select_option("#filter-column", "status")
            page.fill("#filter-text", "oom")
            assert jobs() == ["6+"]
            page.fill("#filter-text", "out of memory")  # in the reason: not the status
            assert jobs() == []
            page.select_option("#filter-column", "error")
            assert jobs() == ["6+"]
            page.select_option("#filter-column", "peak_MiB")
            page.fill("#filter-text", ">20000")
            assert sorted(jobs()) == ["5", "7"]
            page.fill("#filter-text", "<= 15000")
            assert jobs() == ["0"]
            page.select_option("#filter-column", "data.path")
            page.fill("#filter-text", "<script")
            assert jobs() == ["1"]
            cell = page.locator("tbody tr:not(.reason)", has_text="alert(1)").first
            assert "<script>alert(1)</script>.jsonl" in cell.inner_text()
            page.fill("#filter-text", "")
            assert len(jobs()) == 8 and page.inner_text("#shown-count") == "8 of 8 jobs"
            box = page.locator(".table-box").evaluate("b => [b.scrollWidth, b.clientWidth]")
            assert box[0] <= box[1], box  # sorted, filtered, still 1,280 px
            legend = page.inner_text(".legend")
            assert "Pareto front" in legend and "the baseline, job 0" in legend
        finally:
            browser.close()
    assert not errors, errors
