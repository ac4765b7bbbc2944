"""Every test file has one tier (tests/tiers.py), and collection marks each test with it."""

from pathlib import Path

import pytest
from tiers import FILE_TIERS, SLOW, TIERS, tier_of_file

HERE = Path(__file__).parent


def test_every_test_file_has_exactly_one_tier():
    listed = [stem for stems in FILE_TIERS.values() for stem in stems]
    assert set(FILE_TIERS) == set(TIERS)
    assert len(listed) == len(set(listed)), "a file is listed under two tiers"
    on_disk = {p.stem for p in HERE.glob("test_*.py")}
    assert on_disk - set(listed) == set(), "add these files to tests/tiers.py"
    assert set(listed) - on_disk == set(), "these listed files no longer exist"


def test_collection_marks_each_test_with_its_tier(request):
    own = {m.name for m in request.node.iter_markers()} & set(TIERS)
    assert own == {tier_of_file(Path(__file__).stem)} == {"unit"}


@pytest.mark.engine
def test_an_explicit_tier_replaces_the_files(request):
    own = {m.name for m in request.node.iter_markers()} & set(TIERS)
    assert own == {"engine"}


def test_every_slow_entry_names_a_test_that_exists():
    """A renamed test must not silently leave the slow list (and so join the quick tiers)."""
    for entry in SLOW:
        path, _, name = entry.partition("::")
        source = (HERE.parent / path).read_text()
        function = name.split("[")[0]
        assert not function or f"def {function}(" in source, entry
