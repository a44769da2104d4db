"""Test files have unique basenames: pytest imports them by basename (no __init__.py in tests/), so two
``test_x.py`` in different folders stop the whole collection ("import file mismatch"), as the GGUF export's tests
did beside tests/unit/models/test_gguf.py."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_name_is_unique():
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "conftest.py")
    assert not [name for name, n in names.items() if n > 1]
