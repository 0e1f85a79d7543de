"""docs/failure-modes.md names, for every fault, the test that proves what gpuguard does:
each named test must exist, so the table cannot drift from the suite (a renamed or deleted
test fails here, naming the row)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "failure-modes.md"
# `tests/x/test_y.py::test_name`, `tests/x/test_y.py`, and `…::other_name` (the file named last)
REF = re.compile(r"`((?:tests/[\w/]+\.py)|…)(?:::([\w\[\]-]+))?`")


def _functions(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_test_the_fault_table_names_exists():
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ") and not line.startswith("| when")]
    assert len(rows) >= 40, "the fault table lost its rows"
    missing = []
    last = None  # `…` is the file named last, in this row or the one above
    for row in rows:
        refs = REF.findall(row.rsplit("|", 2)[-2])
        assert refs, f"a row names no test: {row[:80]}"
        for path, name in refs:
            path = last if path == "…" else path
            last = path
            file = REPO / path
            if not file.is_file():
                missing.append(f"{path} (row: {row[:60]})")
            elif name and name.split("[")[0] not in _functions(file):
                missing.append(f"{path}::{name} (row: {row[:60]})")
    assert not missing, "docs/failure-modes.md names tests that do not exist:\n" + "\n".join(missing)
