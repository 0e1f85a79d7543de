"""Whole-output goldens (node_exporter's e2e-output.txt): compare a normalised text with the file
under tests/fixtures/golden/; GPUGUARD_REGEN=1 rewrites it (review the diff). A missing golden
fails: a golden that silently passes when absent checks nothing."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

GOLDEN_DIR = Path(__file__).resolve().parent / "fixtures" / "golden"

# Families whose values depend on the run (wall clock, how long a step took, the machine's own
# load), never on the simulated host. Their sample values become <run>; their labels and the
# series that exist are still compared.
RUN_DEPENDENT_FAMILIES = {
    "gpuguard_collector_duration_seconds",  # time each collector took this scrape
    "gpuguard_last_poll_timestamp_seconds",  # wall time
    "gpuguard_poll_duration_seconds",  # _bucket/_sum: how long the poll took (_count is kept)
    "gpuguard_power_sampler_cpu_seconds",  # CPU the sampler thread used
    "gpuguard_power_sampler_hz",  # achieved sampling rate
    "gpuguard_recorder_bytes",  # SQLite page allocation
    "gpuguard_start_time_seconds",  # wall time the process started
}
# Keys of `status --json` that hold wall time or the scanning process's view.
RUN_DEPENDENT_KEYS = {"time", "scanned_at"}

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$")


def _family(sample: str) -> str:
    for suffix in ("_bucket", "_sum", "_count", "_created", "_total"):
        if sample.endswith(suffix):
            return sample[: -len(suffix)]
    return sample


def normalise_exposition(text: str, replacements: dict[str, str] | None = None) -> str:
    """The Prometheus text with run-dependent values replaced: every sample of a family in
    RUN_DEPENDENT_FAMILIES (a histogram keeps its _count, which is how many polls ran),
    every `*_created` sample (creation wall time), and each `replacements` key (the test's
    tmp folder, the version) by its value. Order is kept: the order of families is part of
    what a scrape looks like."""
    out = []
    for line in text.splitlines():
        for old, new in (replacements or {}).items():
            line = line.replace(old, new)
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            name = m.group(1)
            if name.endswith("_created") or (_family(name) in RUN_DEPENDENT_FAMILIES and not name.endswith("_count")):
                line = f"{name}{m.group(2) or ''} <run>"
        out.append(line)
    return "\n".join(out) + "\n"


def normalise_status(doc: Any) -> Any:
    """`status --json` with wall-time keys (RUN_DEPENDENT_KEYS) set to "<run>"."""
    if isinstance(doc, dict):
        return {k: "<run>" if k in RUN_DEPENDENT_KEYS else normalise_status(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [normalise_status(v) for v in doc]
    return doc


def status_text(doc: Any) -> str:
    return json.dumps(normalise_status(doc), indent=2, sort_keys=True) + "\n"


def check_golden(name: str, text: str) -> None:
    path = GOLDEN_DIR / name
    if os.environ.get("GPUGUARD_REGEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: write it with GPUGUARD_REGEN=1 and review the diff"
    want = path.read_text()
    if text != want:
        diff = [f"line {i + 1}:\n  golden: {a}\n  now:    {b}"
                for i, (a, b) in enumerate(zip(want.splitlines(), text.splitlines())) if a != b][:10]
        lengths = f"{len(want.splitlines())} golden lines, {len(text.splitlines())} now"
        raise AssertionError(f"{name} differs from the golden ({lengths}); GPUGUARD_REGEN=1 rewrites it "
                             "after review:\n" + "\n".join(diff))
