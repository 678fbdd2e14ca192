"""Rewrite docs/API.md's field tables from `trtdisagg.api.fields` (the code is the source).

    python tools/api_doc.py          # rewrite the tables in place
    python tools/api_doc.py --check  # exit 1 if they differ from the code

Each table sits between `<!-- fields:NAME -->` and `<!-- /fields -->`; the text around them is
left alone. tests/unit/test_api_fields.py runs the check.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from trtdisagg.api.fields import CHAT, COMPLETIONS, render_table
from trtdisagg.api.fields_base import FieldRule
from trtdisagg.api.responses_fields import RESPONSES

DOC = Path(__file__).resolve().parent.parent / "docs" / "API.md"
TABLES: dict[str, dict[str, FieldRule]] = {
    "completions": COMPLETIONS,
    "chat": CHAT,
    "responses": RESPONSES,
}
BLOCK = re.compile(r"(<!-- fields:(\w+) -->\n)(.*?)(<!-- /fields -->)", re.DOTALL)


def rendered(text: str) -> str:
    """`text` with every field table replaced by the code's."""

    def table(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise ValueError(f"docs/API.md names an unknown table {name!r}")
        return f"{match.group(1)}{render_table(TABLES[name])}\n{match.group(4)}"

    return BLOCK.sub(table, text)


def tables_in(text: str) -> set[str]:
    return {match.group(2) for match in BLOCK.finditer(text)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    args = parser.parse_args(argv)
    text = DOC.read_text()
    new = rendered(text)
    if args.check:
        missing = set(TABLES) - tables_in(text)
        if new != text or missing:
            print(f"{DOC} differs from trtdisagg/api/fields.py (missing: {sorted(missing)})")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
