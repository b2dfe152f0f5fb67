"""The suite's own order (tests/conftest.py): the files whose tests mostly wait are spread among the others."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from conftest import WAITING_FILES, spread_out


def _items(counts: dict[str, int]) -> list[SimpleNamespace]:
    return [SimpleNamespace(path=Path(f"tests/{name}.py"), n=i) for name, count in counts.items() for i in range(count)]


def test_waiting_files_are_spread_evenly_and_each_stays_whole():
    counts = {"test_a": 40, "test_b": 40, "test_browser": 3, "test_browser_x": 2, "test_c": 40, "test_d": 40}
    items = _items(counts)
    out = spread_out(items, lambda item: item.path.name.startswith(WAITING_FILES))
    assert sorted(map(id, out)) == sorted(map(id, items))  # nothing lost, nothing twice
    names = [item.path.stem for item in out]
    for name, count in counts.items():  # a file's items together, in their order (module fixtures are shared)
        first = names.index(name)
        assert names[first:first + count] == [name] * count
        assert [item.n for item in out[first:first + count]] == list(range(count))
    assert names.index("test_browser") == 40 and names.index("test_browser_x") == 123  # after a quarter, three
    assert [name for name in names if not name.startswith("test_browser")] == sorted(
        name for name in names if not name.startswith("test_browser"))  # the others keep their order


def test_a_run_of_only_waiting_files_or_none_keeps_its_order():
    for counts in ({"test_browser": 2, "test_browser_x": 3}, {"test_a": 2, "test_b": 1}):
        items = _items(counts)
        assert spread_out(items, lambda item: item.path.name.startswith(WAITING_FILES)) == items
