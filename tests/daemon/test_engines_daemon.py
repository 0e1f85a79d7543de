"""The engine watchdog inside the running daemon (issues 5, 6, 8 together): a simulated
vLLM told to stall is declared stalled, the stall alert reaches a real webhook receiver
within 1 s, the engine's processes are killed (SIGTERM, SIGKILL if ignored) within
stall_after + poll + grace, and the action is audited with its evidence. A kernel
gpu_hang on one GPU kills the engine on that GPU at once and leaves the other alone."""
from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from support import STARTS, WebhookReceiver

from engines.engines_harness import SimEngine, alive

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.fuse, pytest.mark.network]  # registered in pyproject.toml


NAMES = """
poll: {interval_seconds: 0.25, discover_seconds: 1}
gpus:
  - {name: r9700-a, match: {bdf: "0000:05:00.0"}}
  - {name: xtx-0, match: {bdf: "0000:aa:00.0"}}
"""


@pytest.fixture
def receiver():
    r = WebhookReceiver()
    yield r
    r.close()


@pytest.fixture
def engines():
    started: list[SimEngine] = []

    def start(kind: str, *args: str) -> SimEngine:
        e = SimEngine(kind, *args)
        started.append(e)
        return e

    yield start
    for e in started:
        e.stop()


def engine_yaml(name: str, e: SimEngine, gpu: str, **kw) -> str:
    opts = {"stall_after": 2, "poll_interval": 0.25, "http_timeout": 0.5, "grace": 1, "action": "kill", **kw}
    extra = ", ".join(f"{k}: {v}" for k, v in opts.items())
    return (f"  - {{name: {name}, kind: {e.kind}, url: \"{e.url}\", process: {{pid_file: null, cmdline: "
            f"'gpuguard.sim.engines --kind {e.kind} --port {e.port}'}}, gpus: [{gpu}], {extra}}}\n")


def test_stalled_engine_alerts_the_webhook_within_a_second_and_is_killed(sim, start_daemon, receiver, engines, wait_for, tmp_path):
    e = engines("vllm")
    cfg = NAMES + f"webhooks: [{{url: \"{receiver.url}\", retries: 0}}]\nengines:\n" + engine_yaml("vllm-a", e, "xtx-0")
    d = start_daemon(sim.mount, cfg)
    e.control("requests", count=2, max_tokens=100000)
    wait_for(lambda: d.value("gpuguard_engine_requests_running", engine="vllm-a"), timeout=STARTS, what="requests running")
    tree = e.tree()
    assert len(tree) >= 2  # the API server and its EngineCore child
    stalled_at = time.time()
    e.control("stall")
    (t_recv, ev), *_ = wait_for(lambda: receiver.events("engine_stalled"), timeout=10, what="the stall webhook")
    assert t_recv - ev["time"] < 1.0, f"webhook {t_recv - ev['time']:.3f} s after the stall was declared"
    assert ev["engine"] == "vllm-a" and ev["severity"] in ("alert", "critical")
    # killed within stall_after + poll + grace (+ one HTTP timeout of the deciding poll)
    wait_for(lambda: not any(alive(p) for p in tree), timeout=2 + 0.25 + 1 + 0.5 + 1.5, what="the engine's processes gone")
    assert time.time() - stalled_at < 2 + 0.25 + 1 + 0.5 + 1.5
    killed = wait_for(lambda: receiver.events("engine_killed"), what="the kill webhook")
    assert killed
    audit = [json.loads(l) for l in (tmp_path / "state" / "audit.jsonl").read_text().splitlines()]
    kill = [a for a in audit if a["what"] == "engine.kill" and a["target"] == "vllm-a"]
    assert kill and kill[0]["who"] == "policy"
    evidence = kill[0]["evidence"]["evidence"]
    # the window tolerates 10 % of a poll interval of jitter (engines/stall.py)
    assert evidence["running"] == 2 and evidence["no_progress_seconds"] >= 2 - 0.1 * 0.25
    m = d.metrics()
    acts = {dict(l)["reason"]: v for (n, l), v in m.items() if n == "gpuguard_engine_actions_total" and dict(l)["engine"] == "vllm-a"}
    assert sum(acts.values()) == 1, acts
    # issue 22: the kill left an incident bundle under state_dir/incidents, listed by the API
    bundles = wait_for(lambda: [b for b in httpx.get(f"{d.base}/v1/incidents", timeout=5).json() if "summary.json" in b["files"]],
                       timeout=30, what="a finished incident bundle")
    assert bundles[0]["engine"] == "vllm-a" and "processes.json" in bundles[0]["files"]
    assert bundles[0]["path"].startswith(str(tmp_path / "state" / "incidents"))
    assert "context.json" in bundles[0]["files"]  # GPU telemetry and kernel lines of those minutes
    # the CLI reads the same state from the running daemon
    import subprocess, sys
    r = subprocess.run([sys.executable, "-m", "gpuguard", "engines", "--api", d.base, "--json"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode in (0, 1), r.stderr
    assert "vllm-a" in r.stdout


@pytest.mark.skipif(not os.access("/dev/kmsg", os.W_OK), reason="needs root: writes to /dev/kmsg")
def test_kernel_hang_on_a_gpu_kills_its_engine_at_once(sim, start_daemon, engines, wait_for):
    on_xtx = engines("llamacpp")
    on_r9700 = engines("sglang")
    cfg = (NAMES + "kernel: {allow_userspace: true, udev: false}\nengines:\n"
           + engine_yaml("llama-xtx", on_xtx, "xtx-0", stall_after=600, action="alert")
           + engine_yaml("sglang-r9700", on_r9700, "r9700-a", stall_after=600, action="alert"))
    d = start_daemon(sim.mount, cfg)
    wait_for(lambda: d.value("gpuguard_engine_up", engine="llama-xtx") == 1.0, timeout=STARTS, what="llama-xtx up")
    xtx_tree, r_tree = on_xtx.tree(), on_r9700.tree()
    t0 = time.monotonic()
    with open("/dev/kmsg", "w") as f:
        f.write("<3>amdgpu 0000:aa:00.0: amdgpu: ring gfx_0.0.0 timeout, signaled seq=77, emitted seq=79\n")
    wait_for(lambda: not any(alive(p) for p in xtx_tree), timeout=5, what="the XTX engine killed")
    assert time.monotonic() - t0 < 3  # at once: no stall window, only the kill's own grace
    assert all(alive(p) for p in r_tree)  # the engine on the other GPU is untouched
    events = httpx.get(f"{d.base}/v1/events", timeout=5).json()
    assert any(e["kind"] == "engine_killed" and e["engine"] == "llama-xtx" for e in events)
    # issue 22: a kill without a stall episode leaves its evidence too: one bundle, for
    # the killed engine only, whose decision names the kernel line that caused it
    bundles = wait_for(lambda: [b for b in httpx.get(f"{d.base}/v1/incidents", timeout=5).json() if "summary.json" in b["files"]],
                       timeout=30, what="a finished incident bundle for the kernel kill")
    assert [b["engine"] for b in bundles] == ["llama-xtx"], bundles
    decision = json.loads(open(os.path.join(bundles[0]["path"], "decision.json")).read())
    assert decision["reason"] == "gpu_hang" and decision["evidence"]["gpu"] == "xtx-0", decision
    procs = json.loads(open(os.path.join(bundles[0]["path"], "processes.json")).read())
    assert {p["pid"] for p in procs} == set(xtx_tree)


def test_sighup_applies_engines_changes(sim, start_daemon, engines, wait_for):
    """Issue 13: a reload adds and removes watched engines in the running daemon."""
    import signal

    a, b = engines("vllm"), engines("llamacpp")
    d = start_daemon(sim.mount, NAMES + "engines:\n" + engine_yaml("vllm-a", a, "xtx-0"))
    wait_for(lambda: d.value("gpuguard_engine_up", engine="vllm-a") == 1, timeout=STARTS, what="vllm-a watched")
    text = d.config.read_text().replace(engine_yaml("vllm-a", a, "xtx-0"), engine_yaml("llama-b", b, "r9700-a"))
    d.config.write_text(text)
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: d.value("gpuguard_engine_up", engine="llama-b") == 1, timeout=20, what="llama-b watched after SIGHUP")
    assert d.value("gpuguard_engine_up", engine="vllm-a") is None
    assert "reload: engines {'added': ['llama-b'], 'removed': ['vllm-a'], 'changed': []}" in d.log.read_text()


def test_a_pause_records_the_gpu_busy_and_power_it_happened_at(sim, start_daemon, engines, wait_for, tmp_path):
    """Issue 22: a freeze that clears by itself is a pause, recorded with what its GPU was
    doing meanwhile (a pause at 100 % busy is the GPU grinding, at 0 % the host stalling)."""
    import signal
    import sqlite3

    e = engines("llamacpp")
    d = start_daemon(sim.mount, NAMES + "engines:\n" + engine_yaml("llama-xtx", e, "xtx-0", stall_after=1, kill_after=60))
    sim.ctl("set_load", bdf="0000:aa:00.0", level=1.0)  # full load: the simulated card reads busy 100 % exactly
    sim.ctl("set_load", bdf="0000:05:00.0", level=0.0)  # another card idle, to tell the two draws apart
    for _ in range(3):  # this sim steps only when told to: let the power average settle
        sim.ctl("step", dt=2.0)
    e.control("requests", count=1, max_tokens=100000)
    wait_for(lambda: (d.value("gpuguard_engine_tokens_per_second", engine="llama-xtx") or 0) > 0, timeout=STARTS, what="decoding")
    wait_for(lambda: d.value("gpuguard_gpu_busy_ratio", gpu="xtx-0") == 1.0, timeout=STARTS, what="xtx-0 at full load")
    os.kill(e.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: [x for x in httpx.get(f"{d.base}/v1/events", timeout=5).json() if x["kind"] == "engine_stalled"],
                 timeout=20, what="the stall declared")
    finally:
        os.kill(e.pid, signal.SIGCONT)  # it clears by itself, long before kill_after
    (pause_ev,) = wait_for(lambda: [x for x in httpx.get(f"{d.base}/v1/events", timeout=5).json()
                                    if x["kind"] == "engine_pause"], timeout=20, what="the pause recorded")
    pause = pause_ev["fields"]["pause"]
    assert pause["running"] == 1 and pause["worst_state"] == "stalled" and pause["seconds"] >= 1
    gpu = pause["gpus"]["xtx-0"]
    assert gpu["busy_ratio_mean"] == 1.0, pause
    # the power is the mean of what the daemon read during the pause (the flight recorder
    # holds the same readings)
    start, end = pause["start"], pause["start"] + pause["seconds"]
    db = str(tmp_path / "state" / "flight.sqlite")

    def readings():
        with sqlite3.connect(db) as c:
            return [r[0] for r in c.execute("SELECT power_w FROM samples WHERE gpu='xtx-0' AND t BETWEEN ? AND ? "
                                            "AND power_w IS NOT NULL", (start, end))]

    watts = wait_for(lambda: len(readings()) >= 2 and readings(), what="the pause's power in the recorder")
    assert min(watts) - 1 <= gpu["power_watts_mean"] <= max(watts) + 1, (gpu, watts)
    idle = d.value("gpuguard_gpu_power_watts", gpu="r9700-a")
    assert gpu["power_watts_mean"] > idle + 50, (gpu, idle)  # a loaded card's draw, not an idle one's
    assert alive(e.pid) and not [x for x in httpx.get(f"{d.base}/v1/events", timeout=5).json()
                                 if x["kind"] == "engine_killed"]


def test_sighup_cannot_add_the_first_engine_to_a_daemon_started_with_none(sim, start_daemon, engines, wait_for):
    """The README's one exception to live engine reloads: no watchdog runs without engines,
    so the first one waits for a restart, and the reload says so instead of pretending."""
    import signal

    a = engines("vllm")
    d = start_daemon(sim.mount, NAMES + "engines: []\n")
    d.config.write_text(d.config.read_text().replace("engines: []\n", "engines:\n" + engine_yaml("vllm-a", a, "xtx-0")))
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "needs restart (kept as running): engines" in d.log.read_text(), timeout=20,
             what="the reload naming engines as needing a restart")
    assert d.value("gpuguard_engine_up", engine="vllm-a") is None
    assert httpx.get(f"{d.base}/v1/config", timeout=5).json()["engines"] == []


def test_status_names_the_processes_holding_each_gpu(tmp_path, start_daemon, engines, wait_for):
    """Issue 13: `status` (API and CLI) says which processes hold each GPU and for which
    engine, from the watchdog's fdinfo attribution. A plain tree of the simulated host: the
    simulated engine's GPU process serves its fdinfo under the host's /proc, as amdgpu does."""
    import subprocess
    import sys

    from gpuguard.sim.runner import build_scenario
    from gpuguard.sim.tree import write_tree

    root = tmp_path / "host"
    write_tree(build_scenario("incident"), str(root))
    e = engines("vllm", "--drm-root", str(root / "proc"), "--gpu-bdf", "0000:aa:00.0", "--vram-mib", "512")
    core = wait_for(lambda: len(e.tree()) == 2 and e.tree()[1], timeout=STARTS, what="the EngineCore")
    d = start_daemon(root, NAMES + "engines:\n" + engine_yaml("vllm-a", e, "xtx-0"))

    def held():
        doc = httpx.get(f"{d.base}/v1/status", timeout=5).json()
        # the hold is listed from fdinfo first and named for its engine once the watchdog has
        # resolved the engine's processes (the soak saw the first answer without the engine)
        return [p for p in doc.get("gpu_processes", {}).get("processes", []) if p["pid"] == core and p.get("engine")]

    (hold,) = wait_for(held, timeout=STARTS, what="the EngineCore's hold in /v1/status")
    assert hold == {"gpu": "xtx-0", "bdf": "0000:aa:00.0", "pid": core, "comm": "VLLM::EngineCor", "engine": "vllm-a",
                    "vram_bytes": 512 * 2**20, "source": "fdinfo"}
    r = subprocess.run([sys.executable, "-m", "gpuguard", "status", "--api", d.base], capture_output=True, text=True,
                       timeout=60)
    assert "GPU processes:" in r.stdout, r.stdout + r.stderr
    (line,) = [l for l in r.stdout.splitlines() if f"pid {core} " in l]
    assert line.split() == ["xtx-0", "pid", str(core), "VLLM::EngineCor", "engine", "vllm-a", "512", "MiB"], line
