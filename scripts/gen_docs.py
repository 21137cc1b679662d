"""Regenerate the flag tables in README.md and docs/flags.md from ``VeriCacheConfig``.

    .venv/bin/python scripts/gen_docs.py           # rewrite the generated blocks
    .venv/bin/python scripts/gen_docs.py --check   # exit 1 naming each stale file

A generated block sits between ``<!-- flags:begin [field,field,...] -->`` and
``<!-- flags:end -->``; without field names it lists every flag. test/test_docs.py runs the
check, so a config change without regenerated docs fails the suite.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("README.md", "docs/flags.md")
BLOCK = re.compile(r"(<!-- flags:begin ?([a-z_,]*) -->\n)(.*?)(<!-- flags:end -->)", re.S)


def regenerate(text: str) -> str:
    from sgl_vericache.config import flag_table

    def table(m: re.Match) -> str:
        names = [n for n in m.group(2).split(",") if n] or None
        return m.group(1) + flag_table(names) + m.group(4)

    return BLOCK.sub(table, text)


def stale_files(root: Path = ROOT) -> list[str]:
    """The files whose generated blocks differ from what the config generates now."""
    return [name for name in FILES if regenerate((root / name).read_text()) != (root / name).read_text()]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        stale = stale_files()
        for name in stale:
            print(f"{name}: flag table out of date; run: .venv/bin/python scripts/gen_docs.py", file=sys.stderr)
        return 1 if stale else 0
    for name in FILES:
        path = ROOT / name
        path.write_text(regenerate(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
