"""`gpuguard demo` as a user runs it: a real process on a free port, scraped, then Ctrl-C.
/metrics carries the telemetry of the simulated incident host in base units; Ctrl-C
stops it cleanly (exit 0, no traceback, the simulated tree unmounted and removed)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(base: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=5).text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def v(m: dict, name: str, **labels) -> float:
    return m[(name, tuple(sorted(labels.items())))]


def test_demo_serves_telemetry_in_base_units_and_stops_on_ctrl_c(tmp_path, wait_for):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpuguard", "demo", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    lines: list[str] = []
    engine_pids: list[int] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops it" in line:
                break
        text = "".join(lines)
        assert f"http://127.0.0.1:{port}/metrics" in text, text
        root = next(l.split(" at ", 1)[1].strip() for l in lines if "simulated host 'incident' at" in l)
        base = f"http://127.0.0.1:{port}"

        def loaded():
            m = scrape(base)
            return m if m.get(("gpuguard_gpu_busy_ratio", (("gpu", "r9700-a"),)), 0) > 0.2 else None

        m = wait_for(loaded, timeout=30, what="load on the demo host")
        names = ("r9700-a", "r9700-b", "xtx-0", "xtx-1")
        for gpu in names:
            assert v(m, "gpuguard_gpu_up", gpu=gpu) == 1.0
            cap = v(m, "gpuguard_gpu_power_cap_watts", gpu=gpu)
            assert 200 <= cap <= 400  # watts, not microwatts
            assert 0 < v(m, "gpuguard_gpu_power_watts", gpu=gpu) <= cap
            for sensor in ("edge", "junction", "mem"):
                assert 15 < v(m, "gpuguard_gpu_temperature_celsius", gpu=gpu, sensor=sensor) < 120  # °C
            assert 1e7 < v(m, "gpuguard_gpu_clock_hertz", gpu=gpu, domain="mclk") < 5e9  # hertz
            assert 20 * 2**30 < v(m, "gpuguard_gpu_vram_total_bytes", gpu=gpu) < 40 * 2**30  # bytes
            assert 0 <= v(m, "gpuguard_gpu_busy_ratio", gpu=gpu) <= 1  # ratio, not percent
            assert 0.3 < v(m, "gpuguard_gpu_voltage_volts", gpu=gpu, rail="vddgfx") < 1.5  # volts
        # the R9700 has large BAR, the XTX the 256 MB BAR of INCIDENTS §5
        assert v(m, "gpuguard_gpu_vram_visible_bytes", gpu="r9700-a") == v(m, "gpuguard_gpu_vram_total_bytes", gpu="r9700-a")
        assert v(m, "gpuguard_gpu_vram_visible_bytes", gpu="xtx-0") == 256 * 2**20
        fuse = not any("plain tree" in l for l in lines)
        if fuse:  # the incident profiles were applied and read back before READY
            assert v(m, "gpuguard_profile_verified", gpu="r9700-a", profile="psu-safe") == 1.0
            assert v(m, "gpuguard_gpu_power_cap_watts", gpu="r9700-a") == 210.0
            assert v(m, "gpuguard_gpu_od_setting", gpu="r9700-a", setting="sclk_offset_mhz") == -500
        # the simulated vLLM engine is watched
        wait_for(lambda: scrape(base).get(("gpuguard_engine_up", (("engine", "vllm-demo"),))) == 1.0,
                 timeout=30, what="the demo engine up")
        # the demo's own engine processes, found from its PID (not every simulated engine on
        # the host: another test's or user's would never stop with this demo): the restart
        # stand-in, the API server and its EngineCore
        mine = {p.pid: " ".join(p.cmdline()) for p in psutil.Process(proc.pid).children(recursive=True)}
        engine_pids = [pid for pid, cmd in mine.items() if "gpuguard.sim.engines" in cmd]
        assert any("--core" in mine[pid] for pid in engine_pids), mine
        assert any("--kind vllm" in mine[pid] and "--core" not in mine[pid] for pid in engine_pids), mine
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        rest, _ = proc.communicate(timeout=30)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    assert "gpuguard demo: stopped" in out
    assert not os.path.exists(root)  # unmounted and the temporary folder removed
    assert "HTTP Request:" not in out  # no per-request log lines
    wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                             for p in engine_pids), timeout=10, what="the demo engine to stop with the demo")


def _engine_tree(demo_pid: int) -> dict[int, str]:
    """The demo's simulated engine processes: the restart stand-in and what it started."""
    out = {}
    try:
        procs = psutil.Process(demo_pid).children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "gpuguard.sim.engines" in cmd:
            out[p.pid] = cmd
    return out


def _alive(pids) -> list[int]:
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_while_the_demo_starts_stops_its_engine_too(tmp_path, wait_for, inherited):
    """The engine starts before the daemon, and on a loaded machine the daemon takes seconds
    to get going: a Ctrl-C in that time stops the demo as cleanly as later, engine included
    (it runs in sessions of its own, out of the terminal's reach). Also when the demo
    inherits SIGINT ignored (started by `cmd &` from a script: the shell sets SIG_IGN, and
    Python then installs no KeyboardInterrupt): the soak run lost the early Ctrl-C that way
    and the demo ran on until the daemon's own handler came, the signal long gone."""
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if inherited == "ignored" else None
    proc = subprocess.Popen([sys.executable, "-m", "gpuguard", "demo", "--tree", "--port", str(free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            preexec_fn=ignore)
    seen: dict[int, str] = {}
    try:
        seen.update(wait_for(lambda: _engine_tree(proc.pid), timeout=60, interval=0.005,
                             what="the demo's engine supervisor"))
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C, before the daemon is up
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()  # ours: never left running for the tests after this one
            out, _ = proc.communicate(timeout=10)
            raise AssertionError("the demo did not stop within 30 s of Ctrl-C: " + out[-2000:]) from None
    assert "ready:" not in out, "the Ctrl-C came after the start: " + out
    wait_for(lambda: not _alive(seen), timeout=10, what=f"the engine {seen} to stop with the demo")
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "gpuguard demo: stopped" in out, out


def test_the_demo_killed_outright_takes_its_engine_with_it(tmp_path, wait_for):
    """No cleanup runs after SIGKILL: the engine's supervisor notices its parent is gone."""
    proc = subprocess.Popen([sys.executable, "-m", "gpuguard", "demo", "--tree", "--dir", str(tmp_path / "demo"),
                             "--port", str(free_port())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        engine = wait_for(lambda: (t := _engine_tree(proc.pid)) and any("--core" in c for c in t.values()) and t,
                          timeout=60, what="the demo's engine and its core")
    finally:
        proc.kill()
        proc.wait(10)
    wait_for(lambda: not _alive(engine), timeout=10, what=f"the engine {engine} to stop with the demo")


def test_demo_without_mfusepy_names_the_extra_that_brings_profiles(tmp_path):
    """A plain `pip install gpuguard` has no mfusepy: the demo's first line says how to get
    the FUSE host and its profiles, and that extra really carries mfusepy."""
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert any(d.startswith("mfusepy") for d in pyproject["project"]["optional-dependencies"]["demo"])
    # mfusepy absent as in a plain install: None in sys.modules makes its import fail
    run = ("import sys; sys.modules['mfusepy'] = None; from gpuguard.cli import main; "
           f"sys.exit(main(['demo', '--no-engine', '--seconds', '0.5', '--port', '0', "
           f"'--control', {str(tmp_path / 'sim.sock')!r}]))")
    r = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith("gpuguard demo: FUSE not available") and "pip install 'gpuguard[demo]'" in first, first
    assert "without profiles" in first
