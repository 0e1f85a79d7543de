"""A change's audit trail on a filling disk, on a real tiny tmpfs: the record written
before a change also holds space for the records that follow it (each write, the read
back, the outcome), so a change either starts with room for its whole trail or does not
start. Seen: on a 3 MiB state folder, filled, two applies answered 200 and wrote the card
while every record after "started" failed with ENOSPC."""
from __future__ import annotations

import json
import os

import pytest
from service.failsafe_harness import can_mount, fill, tmpfs

from gpuguard.state.audit import RESERVE_BYTES, AuditLog, AuditUnavailable

pytestmark = [pytest.mark.root, pytest.mark.skipif(can_mount() is not None, reason=str(can_mount()))]


def _trail(audit: AuditLog, n: int) -> None:
    for i in range(n):
        audit.profile_record({"action": "write", "who": "test", "why": "trail", "gpu": "xtx-0", "bdf": "0000:03:00.0",
                              "file": "/sys/class/drm/card0/device/pp_od_clk_voltage", "value": f"s 1 {2000 + i}",
                              "note": "x" * 400})


def test_a_change_started_with_its_reserve_writes_its_whole_trail_on_a_disk_that_fills(tmp_path):
    with tmpfs(tmp_path / "state", size="256k") as state:
        audit = AuditLog(state / "audit.jsonl")
        audit.record("gpu.apply", "alice", "test", target="xtx-0", result="started", required=True)
        fill(state)  # something else fills the folder while the change runs
        _trail(audit, 40)  # ~24 KiB: what an apply of a few cards with retries writes
        audit.record("gpu.apply", "alice", "test", target="xtx-0", result="ok")
        records = [json.loads(line) for line in (state / "audit.jsonl").read_text().splitlines()]
        assert [r["result"] for r in records] == ["started"] + ["ok"] * 41
        assert len([r for r in records if r["what"] == "profile_write"]) == 40


def test_a_change_without_room_for_its_trail_is_refused_before_it_starts(tmp_path):
    with tmpfs(tmp_path / "state", size="256k") as state:
        audit = AuditLog(state / "audit.jsonl")
        audit.record("gpu.apply", "alice", "first", target="xtx-0", result="started", required=True)
        fill(state)
        _trail(audit, 60)  # the first change drew its trail from the reserve
        with open(state / "filler", "r+b") as f:  # room for a "started" record, not for a trail
            f.truncate(os.fstat(f.fileno()).st_size - 8192)
        assert RESERVE_BYTES > 8192
        with pytest.raises(AuditUnavailable, match="trail"):
            audit.record("gpu.apply", "alice", "second", target="xtx-0", result="started", required=True)
        assert not any(r["why"] == "second" for r in audit)
        # space again: the next change gets its reserve and starts
        (state / "filler").unlink()
        audit.record("gpu.apply", "alice", "third", target="xtx-0", result="started", required=True)
        assert [r["why"] for r in audit if r["result"] == "started"] == ["first", "third"]


def test_a_short_write_on_a_full_disk_never_leaves_half_a_line(tmp_path):
    with tmpfs(tmp_path / "state", size="256k") as state:
        audit = AuditLog(state / "audit.jsonl")
        audit.record("gpu.apply", "alice", "test", target="xtx-0", result="started", required=True)
        fill(state)
        _trail(audit, 200)  # far past the reserve: some records fail, none is cut
        lines = (state / "audit.jsonl").read_bytes().split(b"\n")
        assert lines[-1] == b""
        for line in lines[:-1]:
            json.loads(line)
