"""Incident bundles: the evidence of an engine stall, taken before the kill
destroys it, under `state_dir/incidents/<engine>-<UTC time>/`:

- `decision.json`  the stall decision and its evidence, the graded-response times;
- `processes.json` each engine process: state, wchan, /proc/PID/stack where readable, CPU
                   times, every thread's state and wchan, its open GPU files with fdinfo;
- `samples.jsonl`  the engine's /health and /metrics readings over the last minutes (and
                   the raw text of the last scrapes);
- `py-spy-<pid>.txt` the Python stacks of every thread (`py-spy dump`, when installed and
                   ptrace is allowed: CAP_SYS_PTRACE);
- `context.json`   the GPU's telemetry and the kernel lines of the same minutes;
- `summary.json`   what was collected, sizes, and what was abandoned or truncated.

The process snapshot is the only part taken before the watchdog acts, and it is bounded
(FAST_TIMEOUT). Everything else runs in a background task, each collector with its own
timeout: a collector that hangs is abandoned and the summary says so; the kill never waits
for it. Bundles are bounded in size (files truncated, noted) and count (oldest pruned)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable

log = logging.getLogger("gpuguard.engines.incidents")

FAST_TIMEOUT = 1.0  # seconds the process snapshot may take before the watchdog acts
MAX_THREADS = 64  # per process, in processes.json


def _read(path: Path, limit: int = 65536) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError as exc:
        return None if isinstance(exc, FileNotFoundError) else f"<unreadable: {exc.strerror}>"


def _stat_fields(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    rest = text[text.rfind(")") + 2:].split()
    try:
        tck = os.sysconf("SC_CLK_TCK")
        return {"state": rest[0], "utime_seconds": int(rest[11]) / tck, "stime_seconds": int(rest[12]) / tck}
    except (IndexError, ValueError):
        return {"stat": text[:200]}


def snapshot_process(pid: int, proc: Path = Path("/proc")) -> dict[str, Any]:
    """One process as /proc shows it now (blocking; may stall on a process in D state)."""
    base = proc / str(pid)
    out: dict[str, Any] = {"pid": pid}
    stat = _read(base / "stat")
    if stat is None:
        out["gone"] = True
        return out
    out.update(_stat_fields(stat))
    out["comm"] = (_read(base / "comm") or "").strip()
    out["cmdline"] = (_read(base / "cmdline") or "").replace("\0", " ").strip()
    out["wchan"] = (_read(base / "wchan") or "").strip()
    status = _read(base / "status") or ""
    out["status"] = {k: v.strip() for k, _, v in (line.partition(":") for line in status.splitlines())
                     if k in ("State", "Threads", "VmRSS", "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")}
    stack = _read(base / "stack")
    out["stack"] = stack if stack is not None else "<absent>"
    threads = []
    try:
        tids = sorted(int(t) for t in os.listdir(base / "task"))[:MAX_THREADS]
    except OSError:
        tids = []
    for tid in tids:
        t = base / "task" / str(tid)
        threads.append({"tid": tid, "comm": (_read(t / "comm") or "").strip(),
                        **_stat_fields(_read(t / "stat")), "wchan": (_read(t / "wchan") or "").strip()})
    out["threads"] = threads
    gpu_fds = []
    try:
        fds = os.listdir(base / "fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(base / "fd" / fd)
        except OSError:
            continue
        if target.startswith("/dev/dri/") or target.startswith(("/dev/kfd", "/dev/nvidia")):
            gpu_fds.append({"fd": int(fd) if fd.isdigit() else fd, "target": target,
                            "fdinfo": _read(base / "fdinfo" / fd, 8192)})
    out["gpu_fds"] = gpu_fds
    return out


def is_python(snap: dict[str, Any]) -> bool:
    argv0 = os.path.basename((snap.get("cmdline") or "").split(" ")[0])
    return argv0.startswith("python") or snap.get("comm", "").startswith("python")


@dataclass
class Collector:
    """A background part of a bundle: `run()` returns {filename: content}."""

    name: str
    run: Callable[[], Awaitable[dict[str, Any]]]
    timeout: float


@dataclass
class Bundle:
    path: Path
    engine: str
    time: float
    notes: list[str] = field(default_factory=list)
    task: asyncio.Task | None = None


class IncidentStore:
    def __init__(self, root: Path | str, *, max_bundles: int = 20, max_bytes: int = 16 * 2**20,
                 collector_timeout: float = 20.0, pyspy: str | None = "auto",
                 context: Callable[[list[str], float, float], dict] | None = None,
                 extra_collectors: Iterable[Callable[["Bundle"], Collector]] = ()) -> None:
        self.root = Path(root)
        self.max_bundles = max_bundles
        self.max_bytes = max_bytes
        self.collector_timeout = collector_timeout
        self.pyspy = shutil.which("py-spy") if pyspy == "auto" else pyspy
        self.context = context  # (gpus, since, until) -> {"gpu_samples": [...], "kernel_lines": [...]}
        self.extra_collectors = list(extra_collectors)  # tests: a collector that hangs
        self.pending: set[asyncio.Task] = set()

    # -- listing -------------------------------------------------------------------------
    def list(self) -> list[dict[str, Any]]:
        out = []
        try:
            dirs = sorted((d for d in self.root.iterdir() if d.is_dir()), key=_age)
        except OSError:
            return []
        for d in dirs:
            try:
                summary = json.loads((d / "summary.json").read_text())
            except (OSError, ValueError):
                summary = {"engine": d.name.rsplit("-", 1)[0], "complete": False}
            files = sorted(p.name for p in d.iterdir() if p.is_file())
            out.append({"name": d.name, "path": str(d), "files": files,
                        "bytes": sum((d / f).stat().st_size for f in files), **summary})
        return out

    # -- one bundle ----------------------------------------------------------------------
    async def begin(self, engine: str, when: float, decision: dict[str, Any], pids: list[int],
                    samples: list[dict[str, Any]], gpus: list[str], window: float) -> Bundle:
        """Take the process snapshot now (bounded), then write the rest in the background.
        Returns at once after the snapshot; the caller acts next."""
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(when)) + f".{int(when * 1000) % 1000:03d}Z"
        path = self.root / f"{engine}-{stamp}"
        bundle = Bundle(path, engine, when)
        try:
            procs = await asyncio.wait_for(asyncio.to_thread(lambda: [snapshot_process(p) for p in pids]), FAST_TIMEOUT)
        except asyncio.TimeoutError:
            procs = [{"pid": p, "note": "not read"} for p in pids]
            bundle.notes.append(f"process snapshot abandoned after {FAST_TIMEOUT:g} s (a process in D state?)")
        collectors: list[Collector] = []
        if self.pyspy:
            for snap in procs:
                if is_python(snap) and not snap.get("gone"):
                    collectors.append(self._pyspy(snap["pid"], stopped=snap.get("state") in ("T", "t")))
        elif any(is_python(s) for s in procs):
            bundle.notes.append("py-spy not installed: no Python stacks (pip install py-spy; needs CAP_SYS_PTRACE)")
        if self.context is not None:
            ctx = self.context
            collectors.append(Collector("context", lambda: _in_thread(lambda: {
                "context.json": ctx(gpus, when - window, time.time())}), self.collector_timeout))
        collectors += [make(bundle) for make in self.extra_collectors]
        first = {"decision.json": decision, "processes.json": procs,
                 "samples.jsonl": "".join(json.dumps(s, default=str) + "\n" for s in samples)}
        task = asyncio.create_task(self._write(bundle, first, collectors), name=f"incident:{path.name}")
        bundle.task = task
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)
        return bundle

    def _pyspy(self, pid: int, stopped: bool = False) -> Collector:
        # A frozen engine (SIGSTOP, state T) cannot be suspended by py-spy ("Failed to
        # suspend process"); it is not running, so reading it without suspending is exact.
        args = ["dump", "--pid", str(pid)] + (["--nonblocking"] if stopped else [])

        async def run() -> dict[str, Any]:
            proc = await asyncio.create_subprocess_exec(self.pyspy, *args, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT)
            try:
                out, _ = await proc.communicate()
            except asyncio.CancelledError:
                proc.kill()
                raise
            text = out.decode(errors="replace")
            if proc.returncode != 0:
                text = f"py-spy exited {proc.returncode} (ptrace needs CAP_SYS_PTRACE):\n{text}"
            return {f"py-spy-{pid}.txt": text}

        return Collector(f"py-spy {pid}", run, self.collector_timeout)

    async def _write(self, bundle: Bundle, first: dict[str, Any], collectors: list[Collector]) -> None:
        budget = [self.max_bytes]
        try:
            await asyncio.to_thread(self._prepare, bundle.path)
            await asyncio.to_thread(self._put_all, bundle, first, budget)
            for c in collectors:
                try:
                    files = await asyncio.wait_for(c.run(), c.timeout)
                except asyncio.TimeoutError:
                    bundle.notes.append(f"{c.name}: abandoned after {c.timeout:g} s")
                    continue
                except Exception as exc:  # noqa: BLE001 - one collector's failure is a note
                    bundle.notes.append(f"{c.name}: failed: {type(exc).__name__}: {exc}")
                    continue
                await asyncio.to_thread(self._put_all, bundle, files, budget)
        finally:
            summary = {"engine": bundle.engine, "time": bundle.time, "complete": True, "notes": bundle.notes,
                       "reason": first.get("decision.json", {}).get("reason"),
                       "action": first.get("decision.json", {}).get("action")}
            try:
                await asyncio.to_thread(self._put, bundle.path / "summary.json", json.dumps(summary, indent=1))
            except OSError as exc:
                log.error("incident bundle %s: cannot write the summary: %s", bundle.path, exc)

    def _prepare(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        bundles = sorted((d for d in self.root.iterdir() if d.is_dir() and d != path), key=_age)
        for old in bundles[: max(0, len(bundles) - (self.max_bundles - 1))]:
            shutil.rmtree(old, ignore_errors=True)  # our own bundles: oldest pruned (bounded count)

    def _put_all(self, bundle: Bundle, files: dict[str, Any], budget: list[int]) -> None:
        for name, content in files.items():
            text = content if isinstance(content, str) else json.dumps(content, indent=1, default=str)
            data = text.encode()
            if len(data) > budget[0]:
                bundle.notes.append(f"{name}: truncated to {max(budget[0], 0)} of {len(data)} bytes (max_bytes)")
                data = data[: max(budget[0], 0)]
            budget[0] -= len(data)
            self._put(bundle.path / name, data)

    @staticmethod
    def _put(path: Path, data: bytes | str) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data if isinstance(data, bytes) else data.encode())
        os.replace(tmp, path)

    async def aclose(self, timeout: float = 5.0) -> None:
        if self.pending:
            done, pending = await asyncio.wait(set(self.pending), timeout=timeout)
            for t in pending:
                t.cancel()


def _age(d: Path) -> tuple[str, str]:
    """Oldest first across engines: `<engine>-<UTC stamp>`, the stamp has no '-'."""
    return (d.name.rsplit("-", 1)[-1], d.name)


async def _in_thread(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    return await asyncio.to_thread(fn)
