"""Fixtures for the service layer: a real uvicorn server in a thread serving the API app
with stand-in providers (the real profile/engine/cache/PCIe providers live on other
branches), a token file, and a datagram socket that plays systemd's NOTIFY_SOCKET."""
from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import uvicorn

from gpuguard.config import Config
from gpuguard.control.actions import ActionRefused, Actions, UnknownTarget
from gpuguard.control.auth import AccessPolicy, TokenStore
from gpuguard.sinks.api import build_app
from gpuguard.sinks.metrics import MetricsSink
from gpuguard.state.audit import AuditLog
from gpuguard.state.hub import HostSnapshot, Hub
from gpuguard.state.snapshot import GpuSnapshot
from support import poll_until

TOKENS = {"alice": "a" * 8 + "-alice-token-0123456789", "ci": "c" * 8 + "-ci-token-0123456789"}


def wait_for(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll `cond` until it returns something truthy; fail naming `what` at the deadline."""
    return poll_until(cond, timeout, what, interval=0.01)


def write_token_file(path: Path, tokens: dict[str, str] = TOKENS, mode: int = 0o600) -> Path:
    path.write_text("".join(f"{n}: {t}\n" for n, t in tokens.items()))
    os.chmod(path, mode)
    return path


class StandInHost:
    """Providers with the contract of control/actions.py; they record every call so tests
    can prove a refused request never reached them."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.state = {"gpu0": {"od": "stock"}, "gpu1": {"od": "stock"}}

    def apply_profile(self, gpu: str, profile: str, who: str) -> dict:
        self.calls.append(("apply_profile", gpu, profile, who))
        if profile == "refused":
            raise ActionRefused("sclk offset +2000 is outside OD_RANGE -500..1000")
        self.state[gpu] = {"od": profile}
        return {"applied": profile, "read_back": True}

    def reset_gpu(self, gpu: str, who: str) -> dict:
        self.calls.append(("reset_gpu", gpu, who))
        self.state[gpu] = {"od": "stock"}
        return {"reset": gpu}

    def snapshot_state(self, gpu: str) -> dict:
        self.calls.append(("snapshot_state", gpu))
        return dict(self.state[gpu])

    def restore_state(self, gpu: str, state: dict) -> dict:
        self.calls.append(("restore_state", gpu, state))
        self.state[gpu] = dict(state)
        return {"restored": state}

    def kill_engine(self, name: str, who: str) -> dict:
        self.calls.append(("kill_engine", name, who))
        return {"killed_pids": [4242]}

    def restart_engine(self, name: str, who: str) -> dict:
        self.calls.append(("restart_engine", name, who))
        return {"restarted": name}

    def quarantine_cache(self, name: str, who: str) -> dict:
        self.calls.append(("quarantine_cache", name, who))
        if name == "ghost":
            raise UnknownTarget(f"cache {name!r} vanished")
        return {"renamed_to": f"/srv/cache/{name}.BROKEN-test"}

    def engines(self) -> list[dict]:
        return [{"name": "vllm-a", "kind": "vllm", "state": "stalled"}, {"name": "llama-b", "kind": "llama-server", "state": "ok"}]

    def profiles(self) -> list[dict]:
        return [{"name": "quiet"}, {"name": "psu-safe"}, {"name": "refused"}]

    def caches(self) -> list[str]:
        return ["vllm-compile", "ghost"]

    def pcie(self) -> dict:
        return {"gpus": {"gpu0": {"narrowest_hop": "Gen3 x16"}}}

    def mutating_calls(self) -> list[tuple]:
        return [c for c in self.calls if c[0] not in ("snapshot_state",)]


def host_hub() -> Hub:
    hub = Hub()
    gpus = tuple(
        GpuSnapshot(name=f"gpu{i}", bdf=f"0000:0{3 + i}:00.0", vendor="1002", device_id="7551", driver="amdgpu",
                    model="Radeon AI PRO R9700", card=f"card{i}", up=True, time=time.time(), power_watts=120.0)
        for i in range(2)
    )
    hub.publish_snapshot(HostSnapshot(time=time.time(), gpus=gpus))
    return hub


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> from its own thread and loop."""

    def __init__(self, app: Any) -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", access_log=False)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        wait_for(lambda: self.server.started, what="uvicorn to start")
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class SwappableApp:
    """One server for a whole module, a fresh app per test (starting uvicorn per test
    costs more than the tests)."""

    app: Any = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def _module_server():
    front = SwappableApp()
    with ServerThread(front) as srv:
        srv.front = front
        yield srv


@pytest.fixture
def api(tmp_path, _module_server):
    """A served API with two GPUs, stand-in providers, two tokens and an audit log."""
    hub = host_hub()
    host = StandInHost()
    actions = Actions()
    actions.provide_from(host)
    audit = AuditLog(tmp_path / "audit.jsonl")
    app = build_app(hub, MetricsSink(hub), tokens=TokenStore(TOKENS), policy=AccessPolicy("127.0.0.1"), audit=audit,
                    actions=actions, max_body_bytes=4096, config_view=lambda: Config().model_dump(mode="json"))
    srv = _module_server
    srv.front.app = app
    srv.app, srv.hub, srv.host, srv.audit = app, hub, host, audit
    yield srv


class NotifySocket:
    """A datagram socket standing where systemd's notify socket would; records every
    message with its arrival time."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="gg-notify-", dir="/tmp")  # AF_UNIX paths are short
        self.path = os.path.join(self.dir, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, str]] = []
        self._stop = False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode("latin-1")))

    def with_line(self, prefix: str, after: float = 0.0) -> list[tuple[float, str]]:
        return [(t, m) for t, m in list(self.messages) if t >= after and any(l.startswith(prefix) for l in m.splitlines())]

    def close(self) -> None:
        self._stop = True
        self.thread.join(2)
        self.sock.close()
        for p in (self.path,):
            if os.path.exists(p):
                os.unlink(p)
        os.rmdir(self.dir)


@pytest.fixture
def notify_socket():
    ns = NotifySocket()
    yield ns
    ns.close()


@pytest.fixture
def wait():
    return wait_for


@pytest.fixture
def tokens():
    return dict(TOKENS)


@pytest.fixture
def make_token_file():
    return write_token_file


@pytest.fixture
def serve():
    """serve(app) -> context manager running it on a real port."""
    return ServerThread


@pytest.fixture
def stand_in():
    return StandInHost, host_hub
