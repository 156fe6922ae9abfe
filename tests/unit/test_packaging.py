"""The command line's own consistency: a docs page per subcommand, matching its help."""

from __future__ import annotations

import sys
from pathlib import Path

from colifs.cli import parser
from colifs.completion import _subparsers
from tests.helpers import ROOT


def test_a_docs_page_per_subcommand_matching_help(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "contrib"))
    try:
        from gen_command_docs import pages
    finally:
        sys.path.pop(0)
    want = pages()
    assert set(want) == {f"{n}.md" for n in _subparsers(parser())}
    for name, text in want.items():
        page = ROOT / "docs" / "commands" / name
        assert page.exists() and page.read_text() == text, f"{page} is stale: run contrib/gen_command_docs.py"
