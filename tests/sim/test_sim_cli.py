"""`gpuguard sim` drives a simulated host over its control socket as a user would: a real
CLI process against a real socket served by SimRunner (the control channel the demo
serves too, here without the demo's extras, so GPUs are named by PCI address)."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from gpuguard.sim.runner import SimRunner, build_scenario


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
