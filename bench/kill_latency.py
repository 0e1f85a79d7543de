"""Detection-to-kill latency of the engine watchdog against simulated engines (real
processes, real signals): for each run a simulated engine is made busy, told to stall, and
the real watchdog loop detects and kills it. Prints per-phase median and worst.

    PYTHONPATH=daemon python bench/kill_latency.py [--runs 20] [--kind vllm] [--ignore-sigterm]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from gpuguard.engines.config import EngineConfig  # noqa: E402
from gpuguard.engines.watchdog import EngineWatchdog  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_sim(kind: str, ignore_sigterm: bool) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "daemon"))
    cmd = [sys.executable, "-m", "gpuguard.sim.engines", "--kind", kind, "--port", str(port)]
    if ignore_sigterm:
        cmd.append("--ignore-sigterm")
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"sim {kind} did not come up on :{port}")


async def one_run(kind: str, args) -> dict:
    proc, port = start_sim(kind, args.ignore_sigterm)
    url = f"http://127.0.0.1:{port}"
    pids = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    cfg = EngineConfig.model_validate({
        "name": "bench", "kind": kind, "url": url,
        "process": {"cmdline": rf"--kind {kind} --port {port}( |$)"},
        "stall_after": args.stall_after, "poll_interval": args.poll, "http_timeout": args.http_timeout,
        "grace": args.grace, "action": "kill"})
    marks: dict[str, float] = {}

    def publish(ev):
        if ev.kind == "engine_stalled":
            marks.setdefault("detected", time.monotonic())

    wd = EngineWatchdog([cfg], lambda r: None, publish)
    task = asyncio.create_task(wd.run())
    try:
        async with httpx.AsyncClient() as c:
            await c.post(url + "/sim/requests", json={"count": 2})
            while not ((s := wd.snapshots().get("bench")) and s.state == "busy" and s.tokens_per_second):
                await asyncio.sleep(0.01)
            await c.post(url + "/sim/stall")
        marks["stall"] = time.monotonic()
        deadline = time.monotonic() + 30
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        marks["gone"] = time.monotonic()
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=5)
        except ChildProcessError:
            pass
    return {"stall_to_detect": marks["detected"] - marks["stall"],
            "detect_to_gone": marks["gone"] - marks["detected"],
            "stall_to_gone": marks["gone"] - marks["stall"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--kind", default="all", choices=("all", "vllm", "sglang", "llamacpp"))
    p.add_argument("--stall-after", type=float, default=2.0)
    p.add_argument("--poll", type=float, default=0.25)
    p.add_argument("--http-timeout", type=float, default=0.2)
    p.add_argument("--grace", type=float, default=1.0)
    p.add_argument("--ignore-sigterm", action="store_true", help="engine ignores SIGTERM: measures escalation")
    args = p.parse_args()
    kinds = ["vllm", "sglang", "llamacpp"] if args.kind == "all" else [args.kind]
    results = []
    for i in range(args.runs):
        kind = kinds[i % len(kinds)]
        r = asyncio.run(one_run(kind, args))
        results.append(r)
        print(f"run {i + 1:2d} {kind:8s} stall->detect {r['stall_to_detect']:.3f} s  "
              f"detect->gone {r['detect_to_gone']:.3f} s  stall->gone {r['stall_to_gone']:.3f} s", flush=True)
    print(f"\n{args.runs} runs, stall_after {args.stall_after:g} s, poll {args.poll:g} s, grace {args.grace:g} s, "
          f"engine {'ignores' if args.ignore_sigterm else 'honours'} SIGTERM")
    print(f"stall_after + poll + grace = {args.stall_after + args.poll + args.grace:.2f} s "
          f"(+ http_timeout {args.http_timeout:g} s when the deciding poll waits out a wedged endpoint)")
    for key in ("stall_to_detect", "detect_to_gone", "stall_to_gone"):
        vals = [r[key] for r in results]
        print(f"{key:16s} median {statistics.median(vals):.3f} s   worst {max(vals):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
