"""INCIDENTS §10: an engine open to the LAN without an API key is said out loud — a WARN in
`doctor`, an `engine_exposed` event and the `gpuguard_engine_exposed` metric from the running
watchdog. Real simulated engine processes bound to real sockets, found through the real /proc,
asked over loopback only."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from gpuguard.engines.exposure import listening_sockets
from gpuguard.engines.metrics import engine_metrics
from gpuguard.engines.watchdog import EngineWatchdog

from engines_harness import DAEMON, engine_cfg, run_watchdog_until

KEY = "sk-test-7f3a"


def _listen(family: int, address: str) -> socket.socket:
    s = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((address, 0))
    s.listen(1)
    return s


def test_listening_sockets_are_read_from_proc_with_their_bound_address():
    wild, loop = _listen(socket.AF_INET, "0.0.0.0"), _listen(socket.AF_INET, "127.0.0.1")
    bound = socket.socket()  # bound, not listening: not a listener
    bound.bind(("127.0.0.1", 0))
    socks = [wild, loop, bound]
    if socket.has_ipv6 and os.path.exists("/proc/net/tcp6"):
        try:
            socks.append(_listen(socket.AF_INET6, "::"))
        except OSError:
            pass
    try:
        found = {(x.address, x.port) for x in listening_sockets([os.getpid()])}
        assert ("0.0.0.0", wild.getsockname()[1]) in found
        assert ("127.0.0.1", loop.getsockname()[1]) in found
        assert not any(port == bound.getsockname()[1] for _, port in found)
        if len(socks) == 4:
            assert ("::", socks[3].getsockname()[1]) in found
        beyond = {(x.address, x.port) for x in listening_sockets([os.getpid()]) if x.beyond_loopback}
        assert ("127.0.0.1", loop.getsockname()[1]) not in beyond and ("0.0.0.0", wild.getsockname()[1]) in beyond
    finally:
        for s in socks:
            s.close()


def _doctor(tmp_path, sim, kind: str) -> subprocess.CompletedProcess:
    cfg = tmp_path / "g.yaml"
    cfg.write_text(f"state_dir: {tmp_path}/state\nengines:\n  - name: {kind}-lan\n    kind: {kind}\n"
                   f"    url: {sim.url}\n    process: {{pid_file: {tmp_path}/engine.pid}}\n")
    empty = tmp_path / "sys"
    empty.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(DAEMON))
    return subprocess.run([sys.executable, "-m", "gpuguard", "doctor", "--sysfs-root", str(empty), "--config", str(cfg)],
                          capture_output=True, text=True, timeout=120, env=env)


def _engine_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if re.match(r"^(OK|WARN|FAIL)\s+engine\s", line)]


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("kind", ["vllm", "llamacpp"])
def test_doctor_warns_about_an_engine_on_all_addresses_that_answers_without_a_key(tmp_path, sims, kind):
    sim = sims(kind, "--host", "0.0.0.0", "--pid-file", str(tmp_path / "engine.pid"))
    r = _doctor(tmp_path, sim, kind)
    assert "Traceback" not in r.stderr, r.stderr
    lines = _engine_lines(r.stdout)
    want = rf"^WARN\s+engine\s+{kind}-lan: listens on 0\.0\.0\.0:{sim.port} and answers without an API key"
    assert any(re.match(want, line) for line in lines), r.stdout
    assert r.returncode >= 1


@pytest.mark.slow
@pytest.mark.network
def test_doctor_is_quiet_about_an_engine_on_loopback(tmp_path, sims):
    sim = sims("vllm", "--host", "127.0.0.1", "--pid-file", str(tmp_path / "engine.pid"))
    r = _doctor(tmp_path, sim, "vllm")
    assert "Traceback" not in r.stderr, r.stderr
    assert not [line for line in _engine_lines(r.stdout) if line.startswith("WARN")], r.stdout


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("kind", ["vllm", "llamacpp"])
def test_doctor_does_not_warn_when_the_engine_on_all_addresses_asks_for_a_key(tmp_path, sims, kind):
    sim = sims(kind, "--host", "0.0.0.0", "--api-key", KEY, "--pid-file", str(tmp_path / "engine.pid"))
    r = _doctor(tmp_path, sim, kind)
    assert "Traceback" not in r.stderr, r.stderr
    lines = _engine_lines(r.stdout)
    assert not [line for line in lines if line.startswith("WARN")], r.stdout
    assert any(f"listens on 0.0.0.0:{sim.port} and asks for an API key" in line and "HTTP 401" in line
               for line in lines), r.stdout


def _exposed_samples(wd) -> dict[tuple[str, str], float]:
    fam = next(m for m in engine_metrics(wd) if m.name == "gpuguard_engine_exposed")
    return {(s.labels["engine"], s.labels["address"]): s.value for s in fam.samples}


@pytest.mark.slow
@pytest.mark.network
def test_running_watchdog_raises_engine_exposed_once_and_exports_the_metric(tmp_path, sims):
    lan = sims("vllm", "--host", "0.0.0.0", "--pid-file", str(tmp_path / "lan.pid"))
    keyed = sims("sglang", "--host", "0.0.0.0", "--api-key", KEY, "--pid-file", str(tmp_path / "keyed.pid"))
    local = sims("llamacpp", "--pid-file", str(tmp_path / "local.pid"))
    cfgs = [engine_cfg("lan", "vllm", lan.url, process={"pid_file": str(tmp_path / "lan.pid")}, poll_interval=0.25),
            engine_cfg("keyed", "sglang", keyed.url, process={"pid_file": str(tmp_path / "keyed.pid")},
                       poll_interval=0.25),
            engine_cfg("local", "llamacpp", local.url, process={"pid_file": str(tmp_path / "local.pid")},
                       poll_interval=0.25)]
    events: list = []
    wd = EngineWatchdog(cfgs, lambda rec: None, events.append)
    import asyncio

    async def scenario():
        # every engine checked, and then a few more polls: the event is raised once, not per poll
        got = await run_watchdog_until(wd, lambda: {"lan", "keyed"} <= {n for n, _ in _exposed_samples(wd)}
                                       and all(s.polls >= 8 for s in wd.snapshots().values())
                                       and len(wd.snapshots()) == 3, 60)
        assert got, (wd.snapshots(), events)

    asyncio.run(scenario())
    exposed = [e for e in events if e.kind == "engine_exposed"]
    assert len(exposed) == 1, exposed
    ev = exposed[0]
    assert ev.engine == "lan" and ev.severity == "warning"
    assert f"listens on 0.0.0.0:{lan.port} and answers without an API key" in ev.message
    samples = _exposed_samples(wd)
    assert samples[("lan", f"0.0.0.0:{lan.port}")] == 1.0
    assert samples[("keyed", f"0.0.0.0:{keyed.port}")] == 0.0
    assert not [k for k in samples if k[0] == "local"], samples  # loopback only: nothing to say
