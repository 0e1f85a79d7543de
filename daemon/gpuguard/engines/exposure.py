"""Whether a watched engine is open to the network without a key (INCIDENTS §10: engine
endpoints without an API key are unsafe on a LAN). Its listening sockets come from /proc
(the socket inodes in each of its processes' fd/ matched against that process's
net/tcp and net/tcp6, state 0A = LISTEN); a socket bound beyond loopback is asked, over
loopback only (nothing is ever sent to another address), whether its API answers without
an Authorization header. One sentence per verdict, said the same by `doctor` and the
daemon's `engine_exposed` event."""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from gpuguard.engines.config import EngineConfig

log = logging.getLogger("gpuguard.engines")
TCP_LISTEN = "0A"
# An endpoint each kind protects with its API key: vLLM and SGLang guard /v1/*;
# llama-server leaves /v1/models public even with --api-key (its public_endpoints), /props not.
KEYED_PATH = {"vllm": "/v1/models", "sglang": "/v1/models", "llamacpp": "/props", "generic": "/v1/models"}


@dataclass(frozen=True)
class Listener:
    address: str  # as bound: 0.0.0.0, ::, 192.168.1.5, 127.0.0.1
    port: int
    pid: int

    @property
    def endpoint(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"

    @property
    def beyond_loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        if ip.version == 6 and ip.ipv4_mapped is not None:  # ::ffff:127.0.0.1 is loopback too
            ip = ip.ipv4_mapped
        return not ip.is_loopback


@dataclass(frozen=True)
class Exposure:
    """One listening socket of an engine bound beyond loopback, and what its API said."""

    engine: str
    listener: Listener
    # open: HTTP 200 without a key; keyed: 401/403; other: another answer or none;
    # unprobed: bound to one address that loopback cannot reach
    verdict: str
    detail: str  # "GET /v1/models -> HTTP 200", "connect failed", ...

    @property
    def exposed(self) -> bool:
        return self.verdict == "open"

    def sentence(self) -> str:
        at = self.listener.endpoint
        if self.verdict == "open":
            return f"listens on {at} and answers without an API key ({self.detail})"
        if self.verdict == "keyed":
            return f"listens on {at} and asks for an API key ({self.detail})"
        if self.verdict == "unprobed":
            return (f"listens on {at}, beyond loopback; whether it needs an API key was not checked "
                    "(gpuguard sends requests to loopback only)")
        return f"listens on {at}; its API did not answer there over loopback ({self.detail})"


def _hex_address(text: str) -> str:
    # /proc/net/tcp{,6} print each 32-bit word of the address in host (little-endian) order
    raw = bytes.fromhex(text)
    host = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, host)


def _socket_inodes(pid: int, proc: Path) -> set[str]:
    out: set[str] = set()
    try:
        fds = os.listdir(proc / str(pid) / "fd")
    except OSError:
        return out  # gone, or not ours to read
    for fd in fds:
        try:
            target = os.readlink(proc / str(pid) / "fd" / fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def listening_sockets(pids: Iterable[int], proc: Path = Path("/proc")) -> list[Listener]:
    """Every TCP socket in LISTEN that one of `pids` holds, each once (a socket inherited by
    a child is the parent's). Each process's own net/tcp: the table of its network namespace."""
    found: dict[tuple[str, int], Listener] = {}
    for pid in pids:
        inodes = _socket_inodes(pid, proc)
        if not inodes:
            continue
        for table in ("tcp", "tcp6"):
            try:
                lines = (proc / str(pid) / "net" / table).read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                f = line.split()
                if len(f) < 10 or f[3] != TCP_LISTEN or f[9] not in inodes:
                    continue
                addr, port = f[1].rsplit(":", 1)
                listener = Listener(_hex_address(addr), int(port, 16), pid)
                found.setdefault((listener.address, listener.port), listener)
    return sorted(found.values(), key=lambda x: (x.port, x.address))


def _loopback_for(address: str) -> str | None:
    """Where to ask a socket bound to `address`: a wildcard is reachable on loopback; one
    bound to a single other address is not (and is never sent to)."""
    if address == "0.0.0.0":
        return "127.0.0.1"
    if address == "::":
        return "127.0.0.1"  # dual-stack; [::1] when it is IPv6-only
    return None


async def _ask(host: str, port: int, path: str, timeout: float) -> tuple[int | None, str]:
    import httpx

    url_host = f"[{host}]" if ":" in host else host
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:  # no Authorization header
        try:
            r = await client.get(f"http://{url_host}:{port}{path}")
        except httpx.HTTPError as exc:
            return None, f"GET {path}: {type(exc).__name__}"
        return r.status_code, f"GET {path} -> HTTP {r.status_code}"


async def probe_listener(cfg: EngineConfig, listener: Listener) -> Exposure:
    path = KEYED_PATH[cfg.kind]
    host = _loopback_for(listener.address)
    if host is None:
        return Exposure(cfg.name, listener, "unprobed", "")
    status, detail = await _ask(host, listener.port, path, cfg.http_timeout)
    if status is None and listener.address == "::":
        status, detail = await _ask("::1", listener.port, path, cfg.http_timeout)
    verdict = "open" if status == 200 else "keyed" if status in (401, 403) else "other"
    return Exposure(cfg.name, listener, verdict, detail)


async def judge(cfg: EngineConfig, listeners: Iterable[Listener]) -> list[Exposure]:
    """A verdict for each of `listeners` bound beyond loopback (loopback ones need none)."""
    return list(await asyncio.gather(*(probe_listener(cfg, x) for x in listeners if x.beyond_loopback)))


async def check(cfg: EngineConfig, pids: Iterable[int], proc: Path = Path("/proc")) -> list[Exposure]:
    """Each of the engine's listening sockets bound beyond loopback, with its verdict."""
    return await judge(cfg, await asyncio.to_thread(listening_sockets, tuple(pids), proc))


EXPOSURE_INTERVAL = 60.0  # seconds between checks of a running engine; also at every (re)start


class ExposureWatch:
    """One engine's last verdicts, for the watchdog: checked when due, and the sockets that
    turned open since the previous check returned once (one event per exposure, not per poll)."""

    def __init__(self, interval: float = EXPOSURE_INTERVAL) -> None:
        self.interval = interval
        self.checked_at: float | None = None
        self.exposures: tuple[Exposure, ...] = ()

    def due(self, now: float, restarted: bool) -> bool:
        return restarted or self.checked_at is None or now - self.checked_at >= self.interval

    def forget(self) -> None:
        """The engine is down: nothing of it listens."""
        self.checked_at, self.exposures = None, ()

    async def update(self, cfg: EngineConfig, pids: Iterable[int], now: float) -> list[Exposure]:
        before = {x.listener.endpoint for x in self.exposures if x.exposed}
        self.checked_at = now  # a check that fails is retried at the interval, not every poll
        try:
            self.exposures = tuple(await check(cfg, pids))
        except Exception:  # noqa: BLE001 - advisory: the watch goes on
            log.exception("engine %s: exposure check failed", cfg.name)
            return []
        return [x for x in self.exposures if x.exposed and x.listener.endpoint not in before]
