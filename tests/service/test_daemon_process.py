"""The daemon as a real process (`python -m gpuguard run`) with NOTIFY_SOCKET pointing at a
datagram socket the test reads: READY=1 only after the first poll was published and the
API serves it; WATCHDOG=1 keeps coming while the loop lives and stops when it is wedged;
SIGHUP keeps the old config when the new one is broken and applies a good one (tokens
included); SIGTERM sends STOPPING=1."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from gpuguard.config import load_config
from gpuguard.daemon import Daemon

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


REPO = Path(__file__).resolve().parents[2]
INTERVAL = 0.15


def config_text(state: Path, interval: float = INTERVAL, token_file: Path | None = None, extra: str = "") -> str:
    return (
        f"state_dir: {state}\n"
        f"recorder: {{path: {state}/flight.sqlite}}\n"
        f"listen: {{address: 127.0.0.1, port: 0}}\n"
        f"poll: {{interval_seconds: {interval}, timeout_seconds: 0.5}}\n"
        f"api:\n  unix_socket: {state}/api.sock\n"
        + (f"  token_file: {token_file}\n" if token_file else "")
        + extra
    )


class DaemonProcess:
    def __init__(self, tmp: Path, notify_path: str, config: str) -> None:
        self.tmp = tmp
        self.cfg = tmp / "gpuguard.yaml"
        self.cfg.write_text(config)
        (tmp / "sys").mkdir(exist_ok=True)  # an empty hardware tree: no GPUs, polls still run
        env = dict(os.environ, NOTIFY_SOCKET=notify_path, PYTHONPATH=str(REPO / "daemon"))
        env.pop("JOURNAL_STREAM", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuguard", "run", "--config", str(self.cfg), "--sysfs-root", str(tmp / "sys")],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.base: str | None = None

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def log_has(self, pattern: str) -> list[str]:
        return [l for l in list(self.lines) if re.search(pattern, l)]

    def find_port(self, wait) -> str:
        line = wait(lambda: self.log_has(r"metrics at http://"), what="the ready log line")[0]
        self.base = re.search(r"(http://[0-9.]+:[0-9]+)/metrics", line).group(1)
        return self.base

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def state_dir():
    d = Path(tempfile.mkdtemp(prefix="gg-", dir="/tmp"))  # short: it holds the UNIX socket
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


@pytest.fixture
def daemon(state_dir, notify_socket, make_token_file, wait):
    tokens = make_token_file(state_dir / "tokens")
    d = DaemonProcess(state_dir, notify_socket.path, config_text(state_dir, token_file=tokens))
    d.tokens_path = tokens
    yield d
    d.stop()


def test_ready_after_the_first_poll_is_served(daemon, notify_socket, wait):
    t_ready, msg = wait(lambda: notify_socket.with_line("READY=1"), what="READY=1")[0]
    base = daemon.find_port(wait)
    # the STATUS sent with READY is the first poll's summary, not "starting: no poll yet"
    assert "STATUS=0/0 GPUs up" in msg.splitlines()
    # the first cycle's WATCHDOG ping precedes READY: the poll finished before READY went out
    assert notify_socket.with_line("WATCHDOG=1") and notify_socket.with_line("WATCHDOG=1")[0][0] <= t_ready
    health = httpx.get(base + "/healthz", timeout=5).json()
    assert health["ok"] is True and health["last_poll"] is not None
    assert len(notify_socket.with_line("READY=1")) == 1


def test_watchdog_keeps_coming_and_stops_when_the_loop_is_wedged(daemon, notify_socket, wait):
    t_ready, _ = wait(lambda: notify_socket.with_line("READY=1"), what="READY=1")[0]
    base = daemon.find_port(wait)
    wait(lambda: len(notify_socket.with_line("WATCHDOG=1", after=t_ready)) >= 5, timeout=5, what="5 WATCHDOG pings")

    # Wedge: the config path becomes a FIFO with no writer and SIGHUP makes the loop read
    # it, so open() blocks the event loop thread itself (what any blocking call in the
    # loop would do). The process stays alive and its threads keep running: a pinger on a
    # timer thread would go on; ours must stop.
    daemon.cfg.unlink()
    os.mkfifo(daemon.cfg)
    daemon.proc.send_signal(signal.SIGHUP)
    t_wedge, _ = wait(lambda: notify_socket.with_line("RELOADING=1"), what="RELOADING=1")[0]
    with pytest.raises(httpx.TimeoutException):
        httpx.get(base + "/healthz", timeout=1.5)  # the loop does not answer; meanwhile 10 intervals pass
    assert daemon.proc.poll() is None
    assert notify_socket.with_line("WATCHDOG=1", after=t_wedge + 0.05) == []

    # Unwedge: a writer hands it a good config; the loop resumes, pings resume.
    fd = os.open(daemon.cfg, os.O_WRONLY | os.O_NONBLOCK)  # the daemon is the waiting reader
    os.write(fd, config_text(daemon.tmp, interval=0.2, token_file=daemon.tokens_path).encode())
    os.close(fd)
    t_back, _ = wait(lambda: notify_socket.with_line("READY=1", after=t_wedge), what="READY=1 after the reload")[0]
    wait(lambda: len(notify_socket.with_line("WATCHDOG=1", after=t_back)) >= 3, timeout=5, what="pings after the wedge")
    assert httpx.get(base + "/v1/config", timeout=5).json()["poll"]["interval_seconds"] == 0.2


def test_sighup_keeps_the_old_config_when_the_new_one_is_broken(daemon, notify_socket, wait, tokens, make_token_file):
    wait(lambda: notify_socket.with_line("READY=1"), what="READY=1")
    base = daemon.find_port(wait)
    http = httpx.Client(base_url=base, timeout=5)
    alice = {"Authorization": f"Bearer {tokens['alice']}"}
    assert http.get("/v1/config").json()["poll"]["interval_seconds"] == INTERVAL
    assert http.post("/v1/engines/x/kill", headers=alice).status_code == 501  # authenticated; no engine provider

    # broken: out of range, on line 4
    daemon.cfg.write_text(config_text(daemon.tmp, interval=99, token_file=daemon.tokens_path))
    t0 = time.monotonic()
    daemon.proc.send_signal(signal.SIGHUP)
    wait(lambda: daemon.log_has(r"reload rejected.*poll\.interval_seconds \(line 4\)"), what="the rejection log line")
    wait(lambda: notify_socket.with_line("READY=1", after=t0), what="READY=1 after the rejected reload")
    assert http.get("/v1/config").json()["poll"]["interval_seconds"] == INTERVAL
    wait(lambda: len(notify_socket.with_line("WATCHDOG=1", after=t0)) >= 3, what="pings with the old config")

    # a token file other users can read is refused on reload: old config and tokens stay
    loose = make_token_file(daemon.tmp / "loose-tokens", {"bob": "b" * 24}, mode=0o644)
    daemon.cfg.write_text(config_text(daemon.tmp, interval=0.3, token_file=loose))
    daemon.proc.send_signal(signal.SIGHUP)
    wait(lambda: daemon.log_has(r"reload rejected.*loose-tokens: mode 0644"), what="the token file rejection")
    assert http.get("/v1/config").json()["poll"]["interval_seconds"] == INTERVAL
    assert http.post("/v1/engines/x/kill", headers=alice).status_code == 501

    # good: applied, with its new token file (alice is gone, bob is in)
    tight = make_token_file(daemon.tmp / "tight-tokens", {"bob": "b" * 24})
    daemon.cfg.write_text(config_text(daemon.tmp, interval=0.3, token_file=tight))
    t1 = time.monotonic()
    daemon.proc.send_signal(signal.SIGHUP)
    wait(lambda: daemon.log_has(r"reload: config .* applied poll_interval=0.3s tokens=1"), what="the applied log line")
    assert http.get("/v1/config").json()["poll"]["interval_seconds"] == 0.3
    assert http.post("/v1/engines/x/kill", headers=alice).status_code == 401
    assert http.post("/v1/engines/x/kill", headers={"Authorization": "Bearer " + "b" * 24}).status_code == 501
    reloading = notify_socket.with_line("RELOADING=1", after=t1)[0][0]
    assert notify_socket.with_line("READY=1", after=reloading)


def test_unix_socket_is_private_and_serves_the_api(daemon, notify_socket, wait):
    wait(lambda: notify_socket.with_line("READY=1"), what="READY=1")
    sock = daemon.tmp / "api.sock"
    assert oct(sock.stat().st_mode & 0o777) == oct(0o600)
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://gpuguard", timeout=5) as c:
        assert c.get("/v1/status").json()["summary"] == "0/0 GPUs up"
        assert c.post("/v1/gpus/gpu0/reset").status_code == 401


def test_sigterm_sends_stopping_and_exits_cleanly(daemon, notify_socket, wait):
    wait(lambda: notify_socket.with_line("READY=1"), what="READY=1")
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(10) == 0
    assert notify_socket.with_line("STOPPING=1")
    assert not (daemon.tmp / "api.sock").exists()
    assert not daemon.log_has("Traceback")


def test_loose_token_file_refuses_to_start_with_one_clear_line(state_dir, notify_socket, make_token_file, wait):
    loose = make_token_file(state_dir / "tokens", mode=0o640)
    d = DaemonProcess(state_dir, notify_socket.path, config_text(state_dir, token_file=loose))
    try:
        assert d.proc.wait(15) == 1
        wait(lambda: d.log_has(rf"{loose}: mode 0640 .*chmod 600"), what="the error line")
        assert not d.log_has("Traceback") and notify_socket.with_line("READY=1") == []
    finally:
        d.stop()


def test_ready_waits_for_the_on_ready_work(state_dir, notify_socket, monkeypatch):
    """In process: READY=1 goes out only after every on_ready hook (profile apply and
    read-back registers there) has finished, however long it takes."""
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.path)
    (state_dir / "cfg.yaml").write_text(config_text(state_dir))
    (state_dir / "sys").mkdir()
    cfg = load_config(state_dir / "cfg.yaml")
    done: list[float] = []

    async def main():
        d = Daemon(cfg, sysfs_root=str(state_dir / "sys"))

        async def verify_profiles():
            for _ in range(20):  # several loop turns, as a read-back with retries would take
                await asyncio.sleep(0.01)
            done.append(time.monotonic())

        d.on_ready.append(verify_profiles)
        task = asyncio.create_task(d.run())
        while not notify_socket.with_line("READY=1"):
            assert not task.done(), task.exception()
            await asyncio.sleep(0.01)
        d.request_stop()
        assert await task == 0

    asyncio.run(main())
    t_ready = notify_socket.with_line("READY=1")[0][0]
    assert done and done[0] <= t_ready
