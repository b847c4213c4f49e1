"""pytest imports each test file by its basename (no __init__.py in tests/), so two files of one
name in different tiers stop the whole run at collection. This names the pair before CI does."""

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_a_basename_of_its_own():
    by_name = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name != "conftest.py":
            by_name[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
