"""What the default report (no --event, no --at) is about. A recording that stopped
without a clean stop after its newest alert is about the stop (a SIGKILL after an
earlier `power_headroom_low` centred on the alert and its window ended before the last
10 s of recording; INCIDENTS §2: a trip leaves exactly this). A live or cleanly stopped
recording is about its newest incident, and of that incident's alerts the most severe,
first: a GPU lost, then the `gpus_missing` it causes, is about the loss."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gpuguard.report.history import FlightLog
from gpuguard.report.make import make_report, pick_focus

pytestmark = [pytest.mark.slow]  # registered in pyproject.toml

T0 = float(int(time.time()) - 300)
LAST = T0 + 100.0

WRITER = """
import sys, time
from gpuguard.sinks.recorder import FlightRecorder
from gpuguard.state.events import Event
from gpuguard.state.hub import HostSnapshot
from gpuguard.state.snapshot import GpuSnapshot
db, t0, ending, events = sys.argv[1], float(sys.argv[2]), sys.argv[3], eval(sys.argv[4])
r = FlightRecorder(db)
for i in range(101):
    t = t0 + i
    g = GpuSnapshot(name="r9700-a", bdf="0000:05:00.0", vendor="1002", device_id="7551", driver="amdgpu",
                    model="R9700", card="card1", up=True, time=t, power_watts=200.0 + i)
    evs = [Event(kind, sev, "test", msg, gpu="r9700-a", time=t) for at, kind, sev, msg in events if at == i]
    f = r.record(HostSnapshot(time=t, gpus=(g,)), events=evs)
f.result()
if ending == "clean":
    r.mark_stopped()
    r.close()
print("recorded", flush=True)
time.sleep(120)
"""

HEADROOM = [(20, "power_headroom_low", "alert", "GPU peaks 1190 W of 1200 W")]
LOSS = [(30, "gpu_lost", "critical", "GPU r9700-a lost"), (40, "gpus_missing", "alert", "configured GPU(s) missing")]


class Writer:
    """A real process writing the recording, as the daemon does, then left running,
    killed or stopped cleanly."""

    def __init__(self, db, ending: str, events) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db), repr(T0), ending, repr(events)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "recorded"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def focus_of(db):
    flight = FlightLog.open(str(db))
    try:
        return pick_focus(flight, None, None)
    finally:
        flight.close()


def test_a_recording_killed_after_its_alert_is_reported_at_the_stop(tmp_path):
    db = tmp_path / "flight.sqlite"
    w = Writer(db, "running", HEADROOM)
    try:
        t, event = focus_of(db)  # the writer lives: the alert is the news
        assert (t, event["kind"]) == (T0 + 20, "power_headroom_low")
    finally:
        w.kill()
    t, event = focus_of(db)
    assert (t, event) == (LAST, None)
    flight = FlightLog.open(str(db))
    try:
        rep = make_report(flight)
    finally:
        flight.close()
    assert rep.window.end >= LAST and "recording stopped" in rep.html
    assert "power_headroom_low" in rep.html  # the alert is in the window's table still
    res = subprocess.run([sys.executable, "-m", "gpuguard", "report", "--db", str(db), "-o", str(tmp_path / "r.html")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "report on the last sample" in res.stdout


def test_a_cleanly_stopped_recording_is_about_its_alert(tmp_path):
    db = tmp_path / "flight.sqlite"
    w = Writer(db, "clean", HEADROOM)
    w.kill()  # after its clean stop: the kill changes nothing
    t, event = focus_of(db)
    assert (t, event["kind"]) == (T0 + 20, "power_headroom_low")


def test_a_lost_gpu_is_the_event_not_the_gpus_missing_after_it(tmp_path):
    db = tmp_path / "flight.sqlite"
    w = Writer(db, "clean", LOSS)
    w.kill()
    t, event = focus_of(db)
    assert (t, event["kind"]) == (T0 + 30, "gpu_lost")
    flight = FlightLog.open(str(db))
    try:
        assert '<h1 id="headline">gpu_lost r9700-a' in make_report(flight).html
    finally:
        flight.close()


def test_the_daemon_ends_its_recording_cleanly_on_sigterm_and_not_on_sigkill(tmp_path):
    """What the rules above read, from the real daemon: its recording is seen written
    while it runs, ends with the clean-stop marker on SIGTERM and without it on SIGKILL."""
    from service.failsafe_harness import GuardProcess, config_text, sim_root
    from support import poll_until

    root, db = sim_root(tmp_path), tmp_path / "flight.sqlite"
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text(config_text(tmp_path / "state", tmp_path, None))

    def samples() -> int:
        flight = FlightLog.open(str(db))
        try:
            return flight.q("SELECT count(*) FROM samples")[0][0]
        finally:
            flight.close()

    for ending in ("kill", "term"):
        g = GuardProcess(cfg, root)
        try:
            g.find_base(poll_until, timeout=60)
            before = samples() if db.exists() else 0
            poll_until(lambda: db.exists() and samples() > before, timeout=30, what="samples recorded")
            flight = FlightLog.open(str(db))
            try:
                assert flight.writer_alive()
            finally:
                flight.close()
        finally:
            if ending == "kill":
                g.proc.kill()
                g.proc.wait(10)
            else:
                assert g.stop() == 0
        flight = FlightLog.open(str(db))
        try:
            assert not flight.writer_alive()
            assert flight.stopped_cleanly() is (ending == "term"), ending
        finally:
            flight.close()
