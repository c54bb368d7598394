"""xdist gets the longest test files first, whole and in their own order (tests/schedule.py)."""

from __future__ import annotations

from memlab_testing import REPO
from schedule import (
    UNKNOWN_S,
    file_of,
    longest_first,
    read_weights,
    tier_walls,
    weights_from,
    write_weights,
)


def test_files_go_longest_first_whole_and_in_their_own_order():
    ids = ["a.py::t1", "b.py::t1", "a.py::t2", "c.py::t[x::y]", "b.py::t2", "d.py::t1"]
    files = {i: file_of(n) for i, n in enumerate(ids)}
    assert files[3] == "c.py"
    # d.py is not in the weights: UNKNOWN_S a test; a and d tie and keep the collection's order
    order = longest_first(ids, files, {"a.py": UNKNOWN_S, "b.py": 9.0, "c.py": 30.0})
    assert order == ["c.py::t[x::y]", "b.py::t1", "b.py::t2", "a.py::t1", "a.py::t2", "d.py::t1"]
    assert sorted(order) == sorted(ids)
    assert longest_first(ids, files, {}) == ["a.py::t1", "a.py::t2", "b.py::t1", "b.py::t2",
                                             "c.py::t[x::y]", "d.py::t1"]
    # the check tier's files before the others (one session for two tiers)
    assert longest_first(ids, files, {"c.py": 30.0}, frozenset({"a.py", "d.py"})) == [
        "a.py::t1", "a.py::t2", "d.py::t1", "c.py::t[x::y]", "b.py::t1", "b.py::t2"]


def test_weights_are_summed_from_the_durations_files_and_read_back(tmp_path):
    (tmp_path / "check.tsv").write_text("seconds\toutcome\ttest\n2.50\tpassed\ta.py::t1\n"
                                        "1.00\tfailed\ta.py::t2[p]\n")
    (tmp_path / "main.tsv").write_text("seconds\toutcome\ttier\tended\ttest\n"
                                       "40.00\tpassed\tmain\t50.0\tb.py::t\n"
                                       "0.25\tskipped\tmain\t51.0\ta.py::t3\n"
                                       "2.00\tpassed\tcheck\t9.0\ta.py::t1\n")
    # a.py::t1 is in both: once, from the file given last
    weights = weights_from(sorted(tmp_path.glob("*.tsv")))
    assert weights == {"a.py": 3.25, "b.py": 40.0}
    assert tier_walls(tmp_path / "main.tsv") == [("check", 9.0), ("main", 41.0)]  # skipped: not counted
    write_weights(weights, tmp_path / "w.tsv")
    assert read_weights(tmp_path / "w.tsv") == {"b.py": 40.0, "a.py": 3.2}
    assert read_weights(tmp_path / "none.tsv") == {}


def test_the_shipped_weights_name_test_files_and_this_session_runs_in_their_order(request):
    """This very session's tests (``make test``'s whole suite, or what was named) are in the
    order xdist will hand them out: each file whole, the check tier's first, longest first."""
    weights = read_weights()
    assert weights and all(name.startswith("tests/") for name in weights)
    assert sum(1 for name in weights if (REPO / name).exists()) >= 0.9 * len(weights)
    items = request.session.items
    files: list[str] = []
    for item in items:
        if not files or files[-1] != file_of(item.nodeid):
            assert file_of(item.nodeid) not in files, f"{item.nodeid}: its file is split"
            files.append(file_of(item.nodeid))
    check = {file_of(i.nodeid) for i in items if dict(i.user_properties).get("tier") == "check"}
    count = {name: sum(1 for i in items if file_of(i.nodeid) == name) for name in files}
    key = [(name not in check, -weights.get(name, UNKNOWN_S * count[name])) for name in files]
    assert key == sorted(key), list(zip(files, key))
