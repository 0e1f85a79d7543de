"""The flight recorder keeps what it recorded across a process that dies without warning
(the power trip of INCIDENTS §2 is a SIGKILL as far as the process is concerned)."""
from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

from gpuguard.sinks.recorder import FlightRecorder
from gpuguard.state.events import Event
from gpuguard.state.hub import HostSnapshot
from gpuguard.state.snapshot import GpuSnapshot


def snap(t: float, power: float) -> HostSnapshot:
    g = GpuSnapshot(
        name="r9700-a", bdf="0000:05:00.0", vendor="1002", device_id="7551", driver="amdgpu",
        model="R9700", card="card1", up=True, time=t, power_watts=power, temperatures={"edge": 50.0, "junction": 61.0},
    )
    return HostSnapshot(time=t, gpus=(g,))


def test_samples_survive_sigkill(tmp_path):
    db = tmp_path / "flight.sqlite"
    T0 = float(int(time.time()) - 100)
    code = textwrap.dedent(
        f"""
        import os, sys, time
        from gpuguard.sinks.recorder import FlightRecorder
        from gpuguard.state.hub import HostSnapshot
        from gpuguard.state.snapshot import GpuSnapshot
        r = FlightRecorder({str(db)!r})
        T0 = {T0!r}
        for i in range(5):
            g = GpuSnapshot(name="r9700-a", bdf="0000:05:00.0", vendor="1002", device_id="7551", driver="amdgpu",
                            model="R9700", card="card1", up=True, time=T0 + i, power_watts=260.0 + i)
            r.record(HostSnapshot(time=T0 + i, gpus=(g,))).result()
        print("recorded", flush=True)
        time.sleep(60)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "recorded"
    p.send_signal(signal.SIGKILL)  # no chance to close or flush anything
    p.wait()
    rows = sqlite3.connect(db).execute("SELECT t, gpu, power_w FROM samples ORDER BY t").fetchall()
    assert rows == [(T0 + i, "r9700-a", 260.0 + i) for i in range(5)]


def test_events_and_pruning(tmp_path):
    r = FlightRecorder(str(tmp_path / "f.sqlite"), keep_seconds=60)
    r.record(snap(1.0, 100.0)).result()  # far in the past: pruned at the next write
    r._last_prune = 0
    r.record(events=[Event("gpu_lost", "critical", "kernel", "gone", gpu="xtx-0", bdf="0000:aa:00.0")]).result()
    assert r.query("SELECT count(*) FROM samples") == [(0,)]
    assert r.query("SELECT kind, gpu FROM events") == [("gpu_lost", "xtx-0")]
    r.close()


def test_the_writing_connection_keeps_a_small_page_cache(tmp_path):
    """SQLite's default 2 MiB page cache filled within a minute at 32 GPUs and stayed in
    the daemon's RSS (issue 15); the appending connection keeps 256 KiB, and appends
    still land (the cache bounds memory, not what is written)."""
    r = FlightRecorder(str(tmp_path / "f.sqlite"), keep_seconds=3600)
    try:
        now = time.time()
        for i in range(200):
            r.record(snap(now - 200 + i, 100.0 + i))
        r.record().result()
        assert r.query("PRAGMA cache_size") == [(-256,)]
        assert r.query("SELECT count(*) FROM samples") == [(200,)]
    finally:
        r.close()


def test_unknown_values_are_null_not_zero(tmp_path):
    r = FlightRecorder(str(tmp_path / "f.sqlite"))
    s = snap(2e9, 0.0)
    g = GpuSnapshot(**{**{f: getattr(s.gpus[0], f) for f in ("name", "bdf", "vendor", "device_id", "driver", "model", "card", "up", "time")}, "errors": {"power_watts": "EIO"}})
    r.record(HostSnapshot(time=2e9, gpus=(g,))).result()
    assert r.query("SELECT power_w, errors FROM samples") == [(None, '{"power_watts": "EIO"}')]
    r.close()


def _commits(rec: FlightRecorder) -> list[str]:
    seen: list[str] = []
    rec._pool.submit(lambda: rec._db.set_trace_callback(
        lambda sql: seen.append(sql) if sql.strip().upper().startswith("COMMIT") else None)).result()
    return seen


def test_power_rows_of_a_cycle_go_in_the_cycles_own_transaction(tmp_path):
    """Issue 15: the daemon's power rows used to be a second commit (and fsync) every second;
    with `cycle=True` they wait for the cycle's record() and share its commit."""
    rec = FlightRecorder(str(tmp_path / "f.sqlite"))
    commits = _commits(rec)
    t = time.time()
    row = (t, "r9700-a", "0000:05:00.0", "power1_average", 20, 290.0, 288.0, 250.0, 0)
    assert rec.record_power({"power_windows": [row]}, cycle=True) is None
    assert rec.query("SELECT count(*) FROM power_windows") == [(0,)]   # held for the cycle
    rec.record(snap(t, 250.0)).result()
    assert commits == ["COMMIT"]
    assert rec.query("SELECT count(*) FROM power_windows") == [(1,)]
    assert rec.query("SELECT count(*) FROM samples") == [(1,)]
    rec.record(snap(t + 1, 251.0)).result()
    assert rec.query("SELECT count(*) FROM power_windows") == [(1,)]   # taken once, not again
    rec.record_power({"power_windows": [row]}).result()                # without cycle: at once
    assert len(commits) == 3
    rec.close()


def test_a_daemon_poll_cycle_is_one_commit(tmp_path):
    """Samples, power windows and the cycle's events: one transaction a cycle."""
    import asyncio

    from gpuguard.config import parse_config
    from gpuguard.daemon import Daemon
    from gpuguard.sim.runner import build_scenario
    from gpuguard.sim.tree import write_tree

    host = build_scenario("incident")
    host.set_load("0000:05:00.0", 1.0)
    host.step(1.0)
    write_tree(host, str(tmp_path / "root"))
    (tmp_path / "kmsg").write_text("")
    cfg = parse_config(f"sysfs_root: {tmp_path / 'root'}\nstate_dir: {tmp_path / 'state'}\n"
                       f"kernel: {{kmsg_path: {tmp_path / 'kmsg'}, udev: false}}\n")

    async def main() -> tuple[list[str], list]:
        d = Daemon(cfg)
        try:
            commits = _commits(d.recorder)
            await d.poller.poll_once()
            await d.poller.poll_once()
            d.recorder._pool.submit(lambda: None).result()   # the queued transactions are done
            return commits, d.recorder.query("SELECT count(*) FROM power_windows")
        finally:
            d.poller.close()
            d.power.close()
            d.recorder.close()

    commits, windows = asyncio.run(main())
    assert commits == ["COMMIT", "COMMIT"] and windows == [(8,)]
