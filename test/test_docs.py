"""The docs stay true to the code: generated flag tables are current, every flag has a row,
and every relative link in the README and docs/ leads somewhere."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_flag_tables_are_current(tmp_path):
    gen = _gen_docs()
    assert gen.stale_files() == [], "run: .venv/bin/python scripts/gen_docs.py"
    # negative control: a table that lost a row is stale
    for name in gen.FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((ROOT / name).read_text())
    flags = tmp_path / "docs" / "flags.md"
    flags.write_text(re.sub(r"^\| `--vericache-draft-len`.*\n", "", flags.read_text(), flags=re.M))
    assert gen.stale_files(tmp_path) == ["docs/flags.md"]


def test_every_flag_has_a_row_in_docs_flags():
    from sgl_vericache.config import VeriCacheConfig, _flag

    table = (ROOT / "docs" / "flags.md").read_text()
    rows = set(re.findall(r"^\| `(--vericache-[a-z0-9-]+)`", table, flags=re.M))
    assert rows == {_flag(f.name) for f in dataclasses.fields(VeriCacheConfig)}


def test_relative_links_resolve():
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not missing, missing
