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

The process snapshot is taken before the watchdog acts, bounded (FAST_TIMEOUT); when the
action follows at once (dump_after = kill_after, the default, or a kill from the API or a
kernel hang) so are the Python stacks (`py-spy dump --nonblocking`, in what is left of the
same budget): py-spy run after the SIGTERM finds the process gone. Everything else runs in
a background task, each collector with its own timeout: a collector that hangs is
abandoned and the summary says so; the kill never waits for it. The summary is
`complete` only when no part is missing, and names each missing part with its reason.
Bundles are bounded in size (files truncated, noted) and count (oldest pruned)."""
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

FAST_TIMEOUT = 1.0  # seconds the process snapshot (and stacks, before an action) may take
STACKS_FLOOR = 0.5  # seconds the stacks before an action get even after a slow snapshot
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
    missing: list[str] = field(default_factory=list)  # parts not in the bundle, each also in notes

    def lack(self, part: str, reason: str) -> None:
        self.missing.append(part)
        self.notes.append(f"{part} missing: {reason}")


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
                    samples: list[dict[str, Any]], gpus: list[str], window: float,
                    before_action: bool = False) -> Bundle:
        """Take the process snapshot now (bounded), then write the rest in the background.
        Returns after the snapshot (and, `before_action`, the Python stacks); the caller
        acts next."""
        started = time.monotonic()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(when)) + f".{int(when * 1000) % 1000:03d}Z"
        path = self.root / f"{engine}-{stamp}"
        bundle = Bundle(path, engine, when)
        try:
            procs = await asyncio.wait_for(asyncio.to_thread(lambda: [snapshot_process(p) for p in pids]), FAST_TIMEOUT)
        except asyncio.TimeoutError:
            procs = [{"pid": p, "note": "not read"} for p in pids]
            bundle.lack("processes.json (the process states)",
                        f"the process snapshot was abandoned after {FAST_TIMEOUT:g} s (a process in D state?)")
        collectors: list[Collector] = []
        stacks: dict[str, Any] = {}
        python = [s for s in procs if is_python(s) and not s.get("gone")]
        if python and not self.pyspy:
            for snap in python:
                bundle.lack(f"py-spy-{snap['pid']}.txt (Python stacks)",
                            "py-spy not installed (not found on PATH: pip install py-spy; needs CAP_SYS_PTRACE)")
        elif python and before_action:
            budget = max(STACKS_FLOOR, FAST_TIMEOUT - (time.monotonic() - started))
            stacks = await self._stacks_now(bundle, [s["pid"] for s in python], budget)
        elif python:
            collectors += [self._pyspy(s["pid"], stopped=s.get("state") in ("T", "t")) for s in python]
        if self.context is not None:
            ctx = self.context
            collectors.append(Collector("context", lambda: _in_thread(lambda: {
                "context.json": ctx(gpus, when - window, time.time())}), self.collector_timeout))
        collectors += [make(bundle) for make in self.extra_collectors]
        first = {"decision.json": decision, "processes.json": procs,
                 "samples.jsonl": "".join(json.dumps(s, default=str) + "\n" for s in samples), **stacks}
        task = asyncio.create_task(self._write(bundle, first, collectors), name=f"incident:{path.name}")
        bundle.task = task
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)
        return bundle

    async def _stacks_now(self, bundle: Bundle, pids: list[int], budget: float) -> dict[str, Any]:
        """Every Python process's stacks at once, before the action: `--nonblocking` (the
        process is not suspended, so it cannot be left stopped by a dump cut short), the
        whole bounded by `budget`. -> {filename: text} of those taken."""
        async def one(pid: int) -> tuple[int, str | None, str | None]:
            try:
                text, failed = await asyncio.wait_for(self._dump_stacks(pid, nonblocking=True), budget)
            except asyncio.TimeoutError:
                return pid, None, f"py-spy did not finish within the {budget:.2g} s allowed before the action"
            return pid, text, failed

        out: dict[str, Any] = {}
        for pid, text, failed in await asyncio.gather(*(one(p) for p in pids)):
            if text is not None:
                out[f"py-spy-{pid}.txt"] = text
            if failed:
                bundle.lack(f"py-spy-{pid}.txt (Python stacks)", failed)
        return out

    async def _dump_stacks(self, pid: int, nonblocking: bool) -> tuple[str, str | None]:
        """-> (py-spy's output, why it failed or None)."""
        try:
            proc = await asyncio.create_subprocess_exec(
                self.pyspy, "dump", "--pid", str(pid), *(["--nonblocking"] if nonblocking else []),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        except OSError as exc:
            return f"cannot run {self.pyspy}: {exc.strerror}\n", f"cannot run {self.pyspy}: {exc.strerror}"
        try:
            out, _ = await proc.communicate()
        except asyncio.CancelledError:
            proc.kill()
            raise
        text = out.decode(errors="replace")
        if proc.returncode == 0:
            return text, None
        why = pyspy_failure(pid, text)
        return f"py-spy exited {proc.returncode} ({why}):\n{text}", f"py-spy exited {proc.returncode}: {why}"

    def _pyspy(self, pid: int, stopped: bool = False) -> Collector:
        # A frozen engine (SIGSTOP, state T) cannot be suspended by py-spy ("Failed to
        # suspend process"); it is not running, so reading it without suspending is exact.
        async def run() -> dict[str, Any]:
            text, failed = await self._dump_stacks(pid, nonblocking=stopped)
            if failed:
                raise _Missing(failed, {f"py-spy-{pid}.txt": text})
            return {f"py-spy-{pid}.txt": text}

        return Collector(f"py-spy-{pid}.txt (Python stacks)", run, self.collector_timeout)

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
                    bundle.missing.append(c.name)
                    continue
                except _Missing as exc:  # what it wrote says why; the part is still missing
                    bundle.lack(c.name, exc.why)
                    files = exc.files
                except Exception as exc:  # noqa: BLE001 - one collector's failure is a note
                    bundle.notes.append(f"{c.name}: failed: {type(exc).__name__}: {exc}")
                    bundle.missing.append(c.name)
                    continue
                await asyncio.to_thread(self._put_all, bundle, files, budget)
        except asyncio.CancelledError:
            bundle.lack("the rest of the bundle", "its writer was stopped (the daemon shutting down)")
            raise
        finally:
            summary = {"engine": bundle.engine, "time": bundle.time, "complete": not bundle.missing,
                       "missing": bundle.missing, "notes": bundle.notes,
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
                bundle.missing.append(f"{name} (truncated)")
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


class _Missing(Exception):
    """A collector that ran but did not get its part: `files` (what it has to say) are kept."""

    def __init__(self, why: str, files: dict[str, Any]) -> None:
        super().__init__(why)
        self.why, self.files = why, files


def pyspy_failure(pid: int, output: str) -> str:
    """The real reason py-spy could not dump `pid`, from its output and the process."""
    low = output.lower()
    if not os.path.exists(f"/proc/{pid}"):
        return "the process had exited"
    if "permission denied" in low or "operation not permitted" in low:
        return "ptrace refused: it needs CAP_SYS_PTRACE (and kernel.yama.ptrace_scope allowing it)"
    if "failed to find python version" in low or "python binary" in low or "python interpreter" in low:
        return "not a Python process py-spy can read"
    first = next((line.strip() for line in output.splitlines() if line.strip().startswith("Error")), None)
    return first or (output.strip().splitlines() or ["no output"])[0][:200]


def _age(d: Path) -> tuple[str, str]:
    """Oldest first across engines: `<engine>-<UTC stamp>`, the stamp has no '-'."""
    return (d.name.rsplit("-", 1)[-1], d.name)


async def _in_thread(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    return await asyncio.to_thread(fn)
