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


def test_unknown_values_are_null_not_zero(tmp_path):
    r = FlightRecorder(str(tmp_path / "f.sqlite"))
    s = snap(2e9, 0.0)
    g = GpuSnapshot(**{**{f: getattr(s.gpus[0], f) for f in ("name", "bdf", "vendor", "device_id", "driver", "model", "card", "up", "time")}, "errors": {"power_watts": "EIO"}})
    r.record(HostSnapshot(time=2e9, gpus=(g,))).result()
    assert r.query("SELECT power_w, errors FROM samples") == [(None, '{"power_watts": "EIO"}')]
    r.close()
