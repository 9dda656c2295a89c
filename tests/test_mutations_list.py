"""The mutation list (tests/mutations.py, `make mutations`) still fits the code: each mutation's text occurs exactly
once where it points, and the tests it runs exist. A mutation whose text moved is reported STALE and checks nothing,
which `make mutations` alone (not part of `make test`) would show only when someone runs it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mutations import MUTATIONS  # noqa: E402


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_each_mutation_applies_exactly_once_and_names_tests_that_exist(mutation):
    for relative, old, new in ((mutation.path, mutation.old, mutation.new), *mutation.also):
        text = (ROOT / relative).read_text()
        assert text.count(old) == 1, f"{relative}: {old!r} occurs {text.count(old)} times (the code moved?)"
        assert old != new
    for argument in mutation.tests:
        if argument.startswith("tests/"):
            assert (ROOT / argument.split("::")[0]).is_file(), argument


def test_mutation_names_are_unique():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names))
