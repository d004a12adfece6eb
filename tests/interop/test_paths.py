"""Every whole Hugging Face family through every door a user walks, as subprocesses of the
CLIs (`_paths.walk`: convert, generate, fine-tune, export, read back), and the table of
docs/hf.md that says so."""

from __future__ import annotations

import _paths
import pytest


@pytest.mark.parametrize("row", list(_paths.FAMILIES))
def test_every_door(row, tmp_path):
    _paths.walk(row, tmp_path)


def test_docs_table_is_the_walks():
    """docs/hf.md's table is what `python tests/interop/_paths.py` writes when every family
    passes every door (which the test above shows)."""
    assert _paths.docs_table() == _paths.table(dict.fromkeys(_paths.FAMILIES))
