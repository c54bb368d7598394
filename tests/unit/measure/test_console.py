"""Text from a run's inputs is shown, never obeyed (:mod:`memlab.measure.console`): on a
terminal, in Markdown, in a spreadsheet; and ``memlab data show`` prints the data's own control
characters as escapes."""

from __future__ import annotations

from memlab.measure.console import (
    csv_cell,
    markdown_code,
    markdown_fence,
    markdown_text,
    printable,
)


def test_printable_escapes_every_control_character():
    assert printable("a\x1b[2Jb\x07\x7f\x9b\u202e") == "a\\x1b[2Jb\\x07\\x7f\\x9b\\u202e"
    assert printable("two\nlines\ttab") == "two\\x0alines\\x09tab"
    assert printable("two\nlines\x1b", keep_newlines=True) == "two\nlines\\x1b"
    assert printable("plain ünïcode") == "plain ünïcode"


def test_markdown_renders_as_the_text_itself():
    assert markdown_text("<img src=x onerror=alert(1)> & [a](b) `c` | *d*") == (
        "&lt;img src=x onerror=alert(1)&gt; &amp; \\[a\\](b) \\`c\\` \\| \\*d\\*")
    assert markdown_code("plain") == "`plain`"
    assert markdown_code("a``b") == "``` a``b ```"
    assert markdown_fence("no ticks") == "```" and markdown_fence("x ```` y") == "`````"


def test_csv_cells_that_would_start_a_formula_are_text():
    for cell in ("=1+1", "+1", "-cmd", "@SUM(A1)"):
        assert csv_cell(cell) == "'" + cell
    assert csv_cell("ok=1") == "ok=1" and csv_cell(-1.5) == -1.5 and csv_cell(None) is None


def test_data_show_prints_the_datas_control_characters_escaped():
    from memlab.cli.data.show import marked_text

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=False):
            return "".join({1: "ok\n", 2: "\x1b]0;owned\x07", 3: "end"}[i] for i in ids)

    text = marked_text(Tokenizer(), [1, 2, 3], {1}, "[[", "]]")
    assert text == "ok\n[[\\x1b]0;owned\\x07]]end"
