"""`gpuguard sim` drives a simulated host over its control socket as a user would: a real
CLI process against a real socket served by SimRunner (the control channel the demo
serves too, here without the demo's extras, so GPUs are named by PCI address)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from gpuguard.sim.runner import SimRunner, build_scenario

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


def sim(sock, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuguard", "sim", "--control", str(sock), *args],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def served(tmp_path):
    host = build_scenario("incident")
    sock = tmp_path / "sim.sock"
    runner = SimRunner(host, interval=0.1, control_socket=str(sock)).start()
    yield host, sock
    runner.stop()


def test_scenarios_are_listed_one_line_each():
    res = subprocess.run([sys.executable, "-m", "gpuguard", "sim", "scenarios"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0
    from gpuguard.sim.runner import SCENARIOS

    lines = res.stdout.splitlines()
    assert len(lines) == len(SCENARIOS)
    assert all(len(l.split(None, 1)) == 2 for l in lines), "every scenario has its line of explanation"


def test_lose_and_return_a_gpu(served, wait_for):
    host, sock = served
    xtx = "0000:b0:00.0"
    res = sim(sock, "lose", xtx)
    assert res.returncode == 0, res.stderr
    wait_for(lambda: xtx not in host.gpus, what="the card off the bus")
    texts = [r.text for r in host.kernel_log]
    assert any("device lost from bus!" in t for t in texts) and any("GPU Recovery Failed: -19" in t for t in texts)
    res = sim(sock, "return", xtx)
    assert res.returncode == 0, res.stderr
    assert xtx in host.gpus
    assert host.read(host.hwmon_path(xtx) + "/power1_cap")  # it answers again
    assert "Initialized amdgpu" in list(host.kernel_log)[-1].text


def test_return_a_lost_gpu_into_another_slot(tmp_path, wait_for):
    host = build_scenario("incident-spare-slot")
    sock = tmp_path / "sim.sock"
    runner = SimRunner(host, interval=0.1, control_socket=str(sock)).start()
    try:
        xtx = "0000:aa:00.0"
        assert sim(sock, "lose", xtx).returncode == 0
        wait_for(lambda: xtx not in host.gpus, what="the card off the bus")
        res = sim(sock, "--json", "return", xtx, "--slot", "0000:00:03.2")
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == '"0000:42:00.0"' and "0000:42:00.0" in host.gpus and xtx not in host.gpus
        # a slot without buses reserved for hotplug: the kernel's refusal, no traceback
        assert sim(sock, "lose", "0000:42:00.0").returncode == 0
        wait_for(lambda: "0000:42:00.0" not in host.gpus, what="the moved card off the bus")
        res = sim(sock, "return", "0000:42:00.0", "--slot", "0000:00:01.0")
        assert res.returncode == 1 and "No bus number available" in res.stderr and "Traceback" not in res.stderr, \
            res.stderr
    finally:
        runner.stop()


def test_reset_wedge_and_load(served, wait_for):
    host, sock = served
    r9700 = "0000:05:00.0"
    assert sim(sock, "load", r9700, "0.8").returncode == 0
    assert host.state()["gpus"][r9700]["load"] == 0.8
    assert sim(sock, "reset", r9700).returncode == 0
    assert any("reset" in r.text.lower() for r in host.kernel_log)
    assert sim(sock, "wedge", r9700, "gpu_busy_percent").returncode == 0
    done = threading.Event()
    threading.Thread(target=lambda: (host.read(host.device_path(r9700) + "/gpu_busy_percent"), done.set()),
                     daemon=True).start()
    assert not done.wait(0.5), "a wedged read must hang"
    assert sim(sock, "unwedge", r9700).returncode == 0
    wait_for(done.is_set, what="the wedged read released")


def test_errors_name_what_to_do(served, tmp_path):
    host, sock = served
    res = sim(sock, "lose", "nonesuch")
    assert res.returncode == 1 and "no GPU named 'nonesuch'" in res.stderr
    res = sim(sock, "engine", "stall")  # a host without the demo's engine
    assert res.returncode == 1 and "unknown op 'engine'" in res.stderr
    res = sim(tmp_path / "absent.sock", "status")
    assert res.returncode == 1 and "is `gpuguard demo` running?" in res.stderr
    assert "Traceback" not in res.stderr


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def itl(engine: str) -> tuple[float, float]:
    """(sum, count) of the engine's vllm:inter_token_latency_seconds, as Prometheus reads it."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{engine}/metrics", timeout=5).text
    fam = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:inter_token_latency_seconds")
    value = {s.name.rsplit("_", 1)[1]: s.value for s in fam.samples if s.name.endswith(("_sum", "_count"))}
    return value["sum"], value["count"]


def test_demo_engine_listens_on_engine_port_and_is_driven_slow_die_and_hang(tmp_path, wait_for):
    """`gpuguard demo --engine-port P`: the simulated vLLM answers on P (and the watchdog
    watches it there); `gpuguard sim engine slow|die|hang` changes what that engine does,
    seen from outside as a user would: the inter-token latency Prometheus would scrape, the
    process behind the port, the watchdog's events and its verdict."""
    import httpx

    port, engine_port = free_port(), free_port()
    sock = tmp_path / "sim.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuguard", "demo", "--tree", "--port", str(port), "--engine-port", str(engine_port),
         "--control", str(sock), "--dir", str(tmp_path / "host")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    api, engine = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{engine_port}"

    def events(kind: str, after: float = 0.0) -> list[dict]:
        return [e for e in httpx.get(f"{api}/v1/events", timeout=5).json() if e["kind"] == kind and e["time"] > after]

    def watched() -> dict:
        return next(e for e in httpx.get(f"{api}/v1/engines", timeout=5).json() if e["name"] == "vllm-demo")

    try:
        banner = []
        for line in proc.stdout:
            banner.append(line)
            if "Ctrl-C stops it" in line:
                break
        assert f"curl -X POST {engine}/sim/stall" in "".join(banner), "".join(banner)
        info = json.loads(sim(sock, "--json", "status").stdout or "{}")  # the control socket answers
        assert info["gpus"], info
        # the engine on the asked port, and the watchdog watching it there
        wait_for(lambda: httpx.get(f"{engine}/health", timeout=2).status_code == 200, timeout=60, what="engine on --engine-port")
        wait_for(lambda: events("engine_ready"), timeout=90, what="the watchdog sees the engine ready", interval=0.5)
        assert watched()["url"] == engine
        first_pid = watched()["pid"]

        # slow: every decode step now takes 0.5 s (the CLI's default), so each new token's
        # latency is 0.5 s. The command reaches the EngineCore through its pipe after the CLI
        # returns: wait until the tokens between two scrapes are all slow ones.
        before = wait_for(lambda: (lambda v: v if v[1] > 0 else None)(itl(engine)), timeout=60, what="tokens generated")
        assert before[0] / before[1] < 0.05  # the demo's 10 ms steps
        res = sim(sock, "engine", "slow")
        assert res.returncode == 0 and res.stdout.strip() == "ok: engine slow", res
        last = [itl(engine)]

        def slow_tokens() -> float | None:
            now, prev = itl(engine), last[0]
            last[0] = now
            return (now[0] - prev[0]) / (now[1] - prev[1]) if now[1] > prev[1] else None

        wait_for(lambda: (slow_tokens() or 0) > 0.45, timeout=90, what="tokens at the slowed step time", interval=0.5)
        res = sim(sock, "engine", "slow", "--step-time", "0.01")  # back to speed for what follows
        assert res.returncode == 0, res.stderr

        # die: the EngineCore exits and its API server follows; the Restart= stand-in brings a new one
        died_at = time.time()
        res = sim(sock, "engine", "die")
        assert res.returncode == 0 and res.stdout.strip() == "ok: engine die", res
        down = wait_for(lambda: events("engine_down", died_at), timeout=60, what="the watchdog sees no process",
                        interval=0.5)
        assert "no process" in down[0]["message"]
        started = wait_for(lambda: events("engine_started", died_at), timeout=90, what="the restarted engine",
                           interval=0.5)
        assert started[0]["fields"]["pid"] != first_pid
        wait_for(lambda: events("engine_ready", died_at), timeout=90, what="the new engine ready", interval=0.5)
        assert httpx.get(f"{engine}/health", timeout=5).status_code == 200  # on the same port again

        # hang: connections are accepted and never answered; the watchdog calls it unresponsive
        res = sim(sock, "engine", "hang")
        assert res.returncode == 0, res.stderr
        with pytest.raises(httpx.TimeoutException):
            httpx.get(f"{engine}/health", timeout=2)
        wait_for(lambda: watched()["state"] in ("unresponsive", "unhealthy", "stalled"), timeout=60,
                 what="the watchdog's verdict on the hung engine", interval=0.5)
        # and the CLI says so when the engine cannot take a command
        res = sim(sock, "engine", "unstall")
        assert res.returncode == 1 and "did not answer" in res.stderr and "Traceback" not in res.stderr
    finally:
        proc.send_signal(2)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
