"""Issue 22 on real simulated-engine processes: a graded response (alert at stall_after,
evidence at dump_after, kill at kill_after), pause statistics for freezes that clear by
themselves, incident bundles (process states, wchan, the readings window, Python stacks
through py-spy), bounded in size and count, and never in the way of the kill."""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from gpuguard.engines.incidents import FAST_TIMEOUT, Collector, IncidentStore
from gpuguard.engines.metrics import engine_metrics
from gpuguard.engines.watchdog import EngineWatchdog

from engines_harness import alive, engine_cfg, run_watchdog_until

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


POLL, GRACE, HTTP_TIMEOUT = 0.25, 0.5, 0.4
SLACK = 2.0  # a loaded 2-core box


def _cfg(sim, **kw):
    base = dict(process={"cmdline": rf"--kind {sim.kind} --port {sim.port}( |$)"}, poll_interval=POLL,
                http_timeout=HTTP_TIMEOUT, grace=GRACE, action="kill", stall_after=1.0)
    return engine_cfg("e", sim.kind, sim.url, **{**base, **kw})


def _bundle(path: Path) -> dict:
    return {p.name: (p.read_text()) for p in path.iterdir() if p.is_file()}


def _kinds(events):
    return [e.kind for e in events]


def test_sigstopped_engine_yields_a_bundle_then_is_killed_at_kill_after(sims, tmp_path):
    sim = sims("llamacpp")
    store = IncidentStore(tmp_path / "incidents", pyspy=None)
    audit, events = [], []
    wd = EngineWatchdog([_cfg(sim, dump_after=1.5, kill_after=3.0)], audit.append, events.append, incidents=store)

    async def scenario():
        await asyncio.to_thread(sim.control, "requests", count=1)
        assert await run_watchdog_until(wd, lambda: (s := wd.snapshots().get("e")) and s.tokens_per_second
                                        and s.polls >= 8, 20)
        os.kill(sim.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        times = {}

        def watch():
            for k in ("engine_stalled", "engine_incident", "engine_killed"):
                if k in _kinds(events) and k not in times:
                    times[k] = time.monotonic() - t0
            return audit and not alive(sim.pid)

        done = await run_watchdog_until(wd, watch, 30)
        await store.aclose()
        return done, times

    done, times = asyncio.run(scenario())
    assert done, _kinds(events)
    # graded: declared at ~1 s, bundle at ~1.5 s, kill at ~3 s (each after the one before)
    assert times["engine_stalled"] < times["engine_incident"] < times["engine_killed"], times
    assert 3.0 - POLL <= times["engine_killed"] <= 3.0 + POLL + GRACE + HTTP_TIMEOUT + SLACK, times
    (folder,) = (tmp_path / "incidents").iterdir()
    assert folder.name.startswith("e-") and folder.name.endswith("Z")
    files = _bundle(folder)
    procs = json.loads(files["processes.json"])
    assert procs[0]["pid"] == sim.pid and procs[0]["state"] == "T" and procs[0]["status"]["State"].startswith("T")
    assert procs[0]["wchan"] != "" and "utime_seconds" in procs[0] and procs[0]["threads"]
    samples = [json.loads(line) for line in files["samples.jsonl"].splitlines()]
    readings = [s for s in samples if s.get("reading")]
    assert len(readings) >= 3 and readings[-1]["reading"]["heartbeat"] > readings[0]["reading"]["heartbeat"]
    assert any("llamacpp:n_decode_total" in s["raw_metrics"]["metrics"] for s in samples if "raw_metrics" in s)
    decision = json.loads(files["decision.json"])
    assert decision["graded"] == {"stall_after": 1.0, "dump_after": 1.5, "kill_after": 3.0}
    summary = json.loads(files["summary.json"])
    assert summary["engine"] == "e"
    # this store runs without py-spy: the Python engine's stacks are the one missing part
    assert not summary["complete"] and summary["missing"] == [f"py-spy-{sim.pid}.txt (Python stacks)"], summary
    assert wd.snapshots()["e"].last_incident == folder.name


def test_freeze_shorter_than_kill_after_is_a_pause_not_a_kill(sims, tmp_path):
    sim = sims("llamacpp")
    audit, events = [], []
    wd = EngineWatchdog([_cfg(sim, kill_after=6.0)], audit.append, events.append,
                        incidents=IncidentStore(tmp_path / "incidents", pyspy=None))

    async def scenario():
        await asyncio.to_thread(sim.control, "requests", count=1)
        assert await run_watchdog_until(wd, lambda: (s := wd.snapshots().get("e")) and s.tokens_per_second, 20)
        os.kill(sim.pid, signal.SIGSTOP)
        assert await run_watchdog_until(wd, lambda: "engine_stalled" in _kinds(events), 20)
        os.kill(sim.pid, signal.SIGCONT)  # it clears by itself, before kill_after
        return await run_watchdog_until(wd, lambda: "engine_pause" in _kinds(events), 20)

    assert asyncio.run(scenario()), _kinds(events)
    assert audit == [] and alive(sim.pid) and "engine_killed" not in _kinds(events)
    recovered = [e for e in events if e.kind == "engine_recovered"]
    assert recovered and "recorded, not killed" in recovered[0].message
    pause = [e for e in events if e.kind == "engine_pause"][0].fields["pause"]
    assert 1.0 <= pause["seconds"] < 6.0 and pause["running"] == 1 and pause["worst_state"] == "stalled"
    fam = next(f for f in engine_metrics(wd) if f.name == "gpuguard_engine_pause_seconds")
    count = next(s.value for s in fam.samples if s.name.endswith("_count"))
    total = next(s.value for s in fam.samples if s.name.endswith("_sum"))
    assert count == 1 and total == pytest.approx(pause["seconds"], abs=0.01)
    assert wd.snapshots()["e"].longest_pause_today_seconds == pytest.approx(pause["seconds"], abs=0.01)


NEEDS_PYSPY = pytest.mark.skipif(shutil.which("py-spy") is None, reason="needs py-spy (pip install py-spy) and ptrace")


def _bundle_of_a_python_engine(sims, tmp_path, freeze) -> tuple:
    """A simulated llama-server decoding under an `alert` watchdog with incident bundles;
    `freeze(sim)` stops its progress; -> (sim, the bundle's folder) once the bundle is written."""
    sim = sims("llamacpp")
    store = IncidentStore(tmp_path / "incidents", collector_timeout=30)
    events: list = []
    wd = EngineWatchdog([_cfg(sim, action="alert")], lambda r: None, events.append, incidents=store)

    async def scenario():
        await asyncio.to_thread(sim.control, "requests", count=1)
        assert await run_watchdog_until(wd, lambda: (s := wd.snapshots().get("e")) and s.tokens_per_second, 20)
        await asyncio.to_thread(freeze, sim)
        assert await run_watchdog_until(wd, lambda: "engine_incident" in _kinds(events), 20)
        await store.aclose(60)

    asyncio.run(scenario())
    (folder,) = (tmp_path / "incidents").iterdir()
    return sim, folder


@NEEDS_PYSPY
def test_pyspy_stacks_name_the_function_a_stalled_python_engine_is_stuck_in(sims, tmp_path):
    # the main loop spins in Core.loop
    sim, folder = _bundle_of_a_python_engine(sims, tmp_path, lambda sim: sim.control("stall"))
    text = (folder / f"py-spy-{sim.pid}.txt").read_text()
    assert "Thread" in text and "main-loop" in text, text  # every thread, by name
    assert "loop (gpuguard/sim/engines_core.py" in text, text  # where the stuck thread is


@NEEDS_PYSPY
def test_pyspy_stacks_of_a_sigstopped_python_engine(sims, tmp_path):
    """A frozen engine (state T) cannot be suspended by py-spy ("Failed to suspend process"):
    it is already stopped, so its stacks are read without suspending it."""
    stopped: list = []

    def freeze(sim):
        os.kill(sim.pid, signal.SIGSTOP)
        stopped.append(sim.pid)

    try:
        sim, folder = _bundle_of_a_python_engine(sims, tmp_path, freeze)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert json.loads((folder / "processes.json").read_text())[0]["state"] == "T"
    text = (folder / f"py-spy-{sim.pid}.txt").read_text()
    assert "Thread" in text and "main-loop" in text and "exited" not in text, text


def test_bundles_are_bounded_in_size_and_count(tmp_path):
    store = IncidentStore(tmp_path / "incidents", max_bundles=3, max_bytes=4000, pyspy=None)

    async def scenario():
        for i in range(5):
            samples = [{"t": i, "pad": "x" * 500} for _ in range(20)]  # ~10 kB > max_bytes
            engine = "zeta" if i == 0 else "alpha"  # oldest first by time, whatever the engine's name
            await store.begin(engine, 1_800_000_000 + i, {"reason": "test", "i": i}, [os.getpid()], samples, [], 60)
            await store.aclose()

    asyncio.run(scenario())
    listed = store.list()
    assert [b["name"] for b in listed] == [f"alpha-20270115T08{m}Z" for m in ("0002.000", "0003.000", "0004.000")]
    for b in listed:
        assert b["bytes"] - len((Path(b["path"]) / "summary.json").read_bytes()) <= 4000
        assert any("truncated" in n for n in b["notes"]), b["notes"]


def test_a_hanging_dump_does_not_delay_the_kill(sims, tmp_path):
    sim = sims("llamacpp")

    def hang(bundle):
        return Collector("forced hang", lambda: asyncio.sleep(30, {}), timeout=3.0)

    store = IncidentStore(tmp_path / "incidents", pyspy=None, extra_collectors=[hang])
    audit, events = [], []
    wd = EngineWatchdog([_cfg(sim)], audit.append, events.append, incidents=store)

    async def scenario():
        await asyncio.to_thread(sim.control, "requests", count=1)
        assert await run_watchdog_until(wd, lambda: (s := wd.snapshots().get("e")) and s.tokens_per_second, 20)
        await asyncio.to_thread(sim.control, "stall")
        t0 = time.monotonic()
        at_kill: list = []

        def killed_yet():
            if audit and not alive(sim.pid):
                folders = list((tmp_path / "incidents").iterdir())
                at_kill.append(bool(folders) and (folders[0] / "summary.json").exists())
                return True
            return False

        done = await run_watchdog_until(wd, killed_yet, 30)
        elapsed = time.monotonic() - t0
        # from the stall's declaration to the processes gone: the dump must not sit in between
        declared = next(e.time for e in events if e.kind == "engine_stalled")
        killed = next(e.time for e in events if e.kind == "engine_killed")
        assert killed - declared <= GRACE + 1.0, (killed - declared, audit[0]["result"])
        (folder,) = (tmp_path / "incidents").iterdir()
        await store.aclose(10)
        return done, elapsed, folder, at_kill[0]

    done, elapsed, folder, complete_at_kill = asyncio.run(scenario())
    assert done and elapsed <= 1.0 + POLL + GRACE + HTTP_TIMEOUT + 2 * SLACK, elapsed
    assert not complete_at_kill  # the dump was still running when the engine was killed
    summary = json.loads((folder / "summary.json").read_text())
    assert "forced hang: abandoned after 3 s" in summary["notes"]
    assert (folder / "processes.json").exists()


# A Python engine of its own (kind generic): a decode thread steps a counter until told to
# wedge (SIGUSR1), then spins inside a function of a name no library has; its HTTP thread
# answers /health and /metrics throughout, the heartbeat flat once wedged.
WEDGING_ENGINE = r"""
import signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
steps, wedge = [0], threading.Event()
def wedged_in_the_decode_step_xyzzy():
    x = 0
    while True:
        x += 1
def decode():
    while not wedge.is_set():
        steps[0] += 1
        time.sleep(0.01)
    wedged_in_the_decode_step_xyzzy()
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        body = (f"engine_running 1\nengine_waiting 0\nengine_steps_total {steps[0]}\n" if self.path == "/metrics"
                else "ok").encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
signal.signal(signal.SIGUSR1, lambda *a: wedge.set())
srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
threading.Thread(target=decode, daemon=True, name="decode").start()
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""


@pytest.fixture
def wedging_engine():
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", WEDGING_ENGINE, "--wedging-engine"], stdout=subprocess.PIPE, text=True)
    port = int(p.stdout.readline())
    yield p, port
    p.kill()
    p.wait(10)


def _wedge_and_kill(wedging_engine, store, gpu_telemetry=None):
    p, port = wedging_engine
    cfg = engine_cfg("py", "generic", f"http://127.0.0.1:{port}", process={"cmdline": r"--wedging-engine$"},
                     gpus=["xtx-0"],
                     metrics={"running": ["engine_running"], "waiting": ["engine_waiting"],
                              "heartbeat": ["engine_steps_total"]},
                     poll_interval=POLL, http_timeout=HTTP_TIMEOUT, grace=GRACE, action="kill", stall_after=1.0)
    audit, events = [], []
    wd = EngineWatchdog([cfg], audit.append, events.append, incidents=store, gpu_telemetry=gpu_telemetry)

    async def scenario():
        assert await run_watchdog_until(wd, lambda: (s := wd.snapshots().get("py")) and s.state == "busy"
                                        and s.polls >= 4, 20), wd.snapshots()
        os.kill(p.pid, signal.SIGUSR1)
        assert await run_watchdog_until(wd, lambda: audit and not alive(p.pid), 30), _kinds(events)
        await store.aclose(30)

    asyncio.run(scenario())
    declared = next(e.time for e in events if e.kind == "engine_stalled")
    killed = next(e.time for e in events if e.kind == "engine_killed")
    (folder,) = store.root.iterdir()
    return p, folder, killed - declared, audit


@NEEDS_PYSPY
def test_the_stacks_are_taken_before_the_kill_when_it_follows_at_once(wedging_engine, tmp_path):
    """dump_after = kill_after (the default): py-spy run after the SIGTERM found the process
    gone ("Failed to parse python binary ... No such file"), and the summary said complete."""
    # the binary pip put beside this Python, not a version manager's shell shim in front of
    # it (pyenv's costs ~0.3 s a call, seconds on a loaded box: the budget is ~1 s)
    import sys
    beside = Path(sys.executable).with_name("py-spy")
    store = IncidentStore(tmp_path / "incidents", collector_timeout=30,
                          pyspy=str(beside) if beside.is_file() else "auto")
    p, folder, took, audit = _wedge_and_kill(wedging_engine, store)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["complete"] and summary["missing"] == [], (summary, took)
    text = (folder / f"py-spy-{p.pid}.txt").read_text()
    assert "wedged_in_the_decode_step_xyzzy" in text and "exited" not in text, text
    assert 'Thread' in text and '"decode"' in text, text  # every thread, by name
    # the stacks come within the snapshot's ~1 s budget: the kill still follows at once
    assert took <= FAST_TIMEOUT + GRACE + SLACK, took
    assert audit[0]["result"]["gone"]


def test_without_pyspy_the_summary_names_the_missing_stacks_and_why(wedging_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # py-spy is not on this PATH
    store = IncidentStore(tmp_path / "incidents")
    # the GPU as the poller reads it during the stall: busy 100 %, its power falling
    watts = iter(range(270, 0, -15))
    p, folder, took, audit = _wedge_and_kill(
        wedging_engine, store, lambda gpus: {g: {"busy_ratio": 1.0, "power_watts": float(next(watts))} for g in gpus})
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["complete"] is False, summary
    assert summary["missing"] == [f"py-spy-{p.pid}.txt (Python stacks)"], summary
    assert any(n.startswith(f"py-spy-{p.pid}.txt (Python stacks) missing: py-spy not installed") for n in summary["notes"])
    assert not (folder / f"py-spy-{p.pid}.txt").exists()
    assert took <= FAST_TIMEOUT + GRACE + SLACK, took
    # the hang's evidence, in words, in the decision (and so in the report and the audit)
    hang = json.loads((folder / "decision.json").read_text())["evidence"]["gpu_during_stall"]
    fell = re.fullmatch(r"GPU xtx-0 busy 100 % while its power fell (\d+) → (\d+) W; no token came for (\S+) s", hang)
    assert fell and int(fell[1]) > int(fell[2]) and float(fell[3]) >= 1.0 - 0.1 * POLL, hang
    assert audit[0]["evidence"]["gpu_during_stall"] == hang


@NEEDS_PYSPY
def test_a_pyspy_failure_names_its_real_reason(tmp_path):
    """py-spy's own words ("Failed to parse python binary ... No such file") were put down
    to ptrace; the reason is read from the process and py-spy's output."""
    import subprocess

    store = IncidentStore(tmp_path / "incidents")
    gone = subprocess.Popen(["python3", "-c", "pass"])
    gone.wait(30)
    not_python = subprocess.Popen(["sleep", "60"])
    try:
        out = asyncio.run(store._dump_stacks(gone.pid, nonblocking=True))
        assert out[1] == "py-spy exited 1: the process had exited", out
        out = asyncio.run(store._dump_stacks(not_python.pid, nonblocking=True))
        assert out[1] == "py-spy exited 1: not a Python process py-spy can read", out
        assert out[0].startswith("py-spy exited 1 (not a Python process py-spy can read):\n")
    finally:
        not_python.kill()
        not_python.wait(10)
