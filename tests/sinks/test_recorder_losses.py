"""Issue 12 item 7: the flight recorder's losses are visible and its size is bounded.

- a full disk (tiny tmpfs): every failed transaction is counted in
  gpuguard_recorder_write_failures_total, and the log says so once, not per row;
- a flood of 5,000 events queues no transaction of its own: they go in the next cycle's
  one transaction with the samples;
- `max_bytes` bounds the pages in use: the oldest rows are pruned.
"""
from __future__ import annotations

import os
import subprocess

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from gpuguard.sinks.recorder import FlightRecorder
from gpuguard.state.events import Event
from gpuguard.state.hub import HostSnapshot
from gpuguard.state.snapshot import GpuSnapshot

pytestmark = [pytest.mark.root]  # registered in pyproject.toml


def snap(t: float, n_gpus: int = 1) -> HostSnapshot:
    gpus = tuple(
        GpuSnapshot(name=f"gpu{i}", bdf=f"0000:0{5 + i}:00.0", vendor="1002", device_id="7551", driver="amdgpu",
                    model="R9700", card=f"card{i}", up=True, time=t, power_watts=261.5, power_cap_watts=300.0,
                    temperatures={"edge": 51.0, "junction": 63.0, "mem": 70.0}, clocks_hz={"sclk": 2.9e9, "mclk": 1.2e9},
                    fan_rpm=1450.0, busy_ratio=0.97, vram_used_bytes=27 << 30)
        for i in range(n_gpus)
    )
    return HostSnapshot(time=t, gpus=gpus)


def scrape(rec: FlightRecorder) -> str:
    class C:
        def collect(self):
            return rec.collect()

    reg = CollectorRegistry()
    reg.register(C())
    return generate_latest(reg).decode()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: mounts a tiny tmpfs")
def test_full_disk_failures_are_counted_and_exported(tmp_path, caplog):
    from service.failsafe_harness import fill, tmpfs

    with tmpfs(tmp_path / "rec", size="512k") as d:
        rec = FlightRecorder(str(d / "flight.sqlite"))
        try:
            rec.record(snap(1e9)).result()
            assert rec.failures == 0
            fill(d)
            for i in range(200):
                rec.record(snap(1e9 + 1 + i, n_gpus=4), events=[Event("x", "info", "t", "y" * 2000)] * 20).result()
            assert rec.failures > 0
            text = scrape(rec)
            assert f"gpuguard_recorder_write_failures_total {float(rec.failures)}" in text
            assert 'gpuguard_recorder_rows_total{table="samples"}' in text and "gpuguard_recorder_bytes " in text
            logged = [r for r in caplog.records if "recorder write failed" in r.getMessage()]
            assert 1 <= len(logged) <= 1 + rec.failures // 100
        finally:
            rec.close()
            (d / "filler").unlink()


def test_flood_of_events_rides_with_the_next_cycle(tmp_path):
    rec = FlightRecorder(str(tmp_path / "f.sqlite"))
    try:
        for i in range(5000):
            rec.add_event(Event("gpu_hang", "alert", "kernel", f"ring timeout {i}", gpu="gpu0"))
        assert rec._pool._work_queue.qsize() == 0  # not one transaction queued by the flood
        rec.record(snap(2e9)).result()
        assert rec.query("SELECT count(*) FROM events") == [(5000,)]
        assert rec.query("SELECT count(*) FROM samples") == [(1,)]
        assert rec.rows == {"samples": 1, "events": 5000}
    finally:
        rec.close()


def test_max_bytes_bounds_the_database_by_pruning_the_oldest(tmp_path):
    rec = FlightRecorder(str(tmp_path / "f.sqlite"), keep_seconds=1e9, max_bytes=1 << 20)
    try:
        t0 = 1.9e9
        for i in range(400):  # about 3 MB of rows without the bound
            rec.record(snap(t0 + i, n_gpus=4), events=[Event("e", "info", "t", "m" * 1500, time=t0 + i)] * 4).result()
            if i % 50 == 49:
                rec._last_prune = 0  # prune at the next write (the daemon does every 60 s)
        rec._last_prune = 0
        rec.record(snap(t0 + 400)).result()
        used = rec._pool.submit(rec.used_bytes).result()
        assert used <= 1 << 20, used
        assert rec.pruned_for_size > 0
        (oldest,), = rec.query("SELECT min(t) FROM samples")
        assert oldest > t0 + 100  # the oldest went, the newest stayed
        assert rec.query("SELECT max(t) FROM samples") == [(t0 + 400,)]
        assert os.stat(rec.path).st_size < 3 << 20
    finally:
        rec.close()


def test_a_deleted_recording_is_reopened_counted_and_said(tmp_path):
    """flight.sqlite and its WAL deleted under the running recorder: writes went on into the
    unlinked inode, nothing counted, `gpuguard record` said "not found". The rows after it
    are in a new file at the path, the loss is counted and a `recorder_file_lost` event
    goes to `publish` (and from there, as the hub does, back into the recording)."""
    import sqlite3

    path = tmp_path / "flight.sqlite"
    published: list[Event] = []
    rec = FlightRecorder(str(path), publish=lambda e: (published.append(e), rec.add_event(e)))
    try:
        rec.record(snap(1e9)).result()
        for suffix in ("", "-wal", "-shm"):
            (tmp_path / f"flight.sqlite{suffix}").unlink(missing_ok=True)
        rec.record(snap(1e9 + 1)).result()
        rec.record(snap(1e9 + 2), events=[Event("gpu_hang", "critical", "kernel", "after the delete")]).result()
        assert path.exists(), "the recording was not reopened at its path"
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            times = [t for (t,) in db.execute("SELECT t FROM samples ORDER BY t")]
            kinds = {k for (k,) in db.execute("SELECT kind FROM events")}
        finally:
            db.close()
        assert times == [1e9 + 1, 1e9 + 2]
        assert kinds == {"gpu_hang", "recorder_file_lost"}
        assert [(e.kind, e.severity, e.fields["what"]) for e in published] == [("recorder_file_lost", "alert", "deleted")]
        assert str(path) in published[0].message
        assert rec.files_lost == 1 and rec.failures == 0
        assert "gpuguard_recorder_file_lost_total 1.0" in scrape(rec)
        # replaced by another file (a restore, a copy over it): the same
        other = tmp_path / "other.sqlite"
        sqlite3.connect(other).close()
        os.replace(other, path)
        rec.record(snap(1e9 + 3)).result()
        rec.record(snap(1e9 + 4)).result()
        assert rec.files_lost == 2 and published[-1].fields["what"] == "replaced by another file"
        assert rec.query("SELECT t FROM samples ORDER BY t") == [(1e9 + 3,), (1e9 + 4,)]
    finally:
        rec.close()
