"""The whole kernel log of the real H200 host (tests/fixtures/h200: `dmesg` and the raw
/dev/kmsg records read from the start of the ring), a healthy boot of a VM with an NVIDIA
driver: every record parses, and no rule fires on it — NVRM's boot chatter such as
`FBHUB Interrupt detected. Clearing it.` is not an event."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gpuguard.kernel.kmsg import parse_record
from gpuguard.kernel.rules import Rules

H200 = Path(__file__).resolve().parents[1] / "fixtures" / "h200"


def raw_records() -> list[bytes]:
    # records are one line each, with continuation (dictionary) lines starting with a space
    out: list[bytes] = []
    for line in (H200 / "kmsg-raw.txt").read_bytes().splitlines(keepends=True):
        if line.startswith(b" ") and out:
            out[-1] += line
        else:
            out.append(line)
    return out


def test_every_real_record_parses_with_monotonic_sequence_numbers():
    recs = [parse_record(r) for r in raw_records()]
    assert len(recs) == 358
    seqs = [r.seq for r in recs]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all(r.facility == 0 for r in recs)  # all from the kernel
    nvrm = [r for r in recs if r.text.startswith("NVRM:")]
    assert nvrm, "the NVIDIA driver's lines are in the sample"


def test_no_rule_fires_on_a_healthy_real_boot():
    rules = Rules.load()
    hits = [(r.text, m.kind) for r in map(parse_record, raw_records()) if (m := rules.classify(r.text))]
    assert hits == []


def test_events_classify_on_the_real_dmesg_finds_nothing():
    r = subprocess.run([sys.executable, "-m", "gpuguard", "events", "classify", str(H200 / "dmesg.txt")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "358 messages, 0 classified" in r.stdout
