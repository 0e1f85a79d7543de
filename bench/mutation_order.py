"""pytest plugin of bench/mutation.sh (loaded in its scratch trees only): run the tests a
mutant is checked against fastest first, by the durations mutmut recorded. mutmut stops
at the first failing test, and passes the tests in no particular order; a mutant the
quick exact tests kill should not first wait out the FUSE and process tests."""
from __future__ import annotations

import json
from pathlib import Path


def pytest_collection_modifyitems(session, config, items):
    stats = Path("mutmut-stats.json")  # mutmut runs the tests inside mutants/
    if not stats.exists():
        return
    try:
        durations = json.loads(stats.read_text())["duration_by_test"]
    except (ValueError, KeyError):
        return
    items.sort(key=lambda item: durations.get(item.nodeid, 1e9))
