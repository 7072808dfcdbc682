"""Rewrite the README's table of `specdec serve` settings from specdec.config.

    python scripts/readme_settings.py          # rewrite the table between its markers
    python scripts/readme_settings.py --check  # exit 1 if the README's table is stale

tests/test_config.py fails when the table and the config disagree.
"""
from __future__ import annotations

import sys
from pathlib import Path

from specdec_app.flags import settings_table
from specdec_app.serve import DRAFT_DEFAULT_NOTE

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- settings table: generated -->\n", "\n<!-- end of settings table -->"


def main() -> int:
    text = README.read_text()
    if START not in text or END not in text:
        print(f"{README}: no settings table markers", file=sys.stderr)
        return 1
    head, rest = text.split(START, 1)
    old, tail = rest.split(END, 1)
    new = settings_table({"draft": DRAFT_DEFAULT_NOTE})
    if "--check" in sys.argv[1:]:
        if old != new:
            print("README settings table is stale: run python scripts/readme_settings.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(head + START + new + END + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
