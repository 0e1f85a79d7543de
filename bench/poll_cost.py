"""Benchmark (not a test): CPU cost of one GPU poll and of a /metrics render.

For 4 GPUs (the incident host) and 32 GPUs (bench32) written as plain sysfs trees:
  raw      the same attribute files read by a bare os.open/os.read/os.close loop
  gpuguard hw.amdgpu.read_gpu (read + parse into an immutable snapshot)
  render   what GET /metrics serves: the whole daemon (every collector: GPUs, PCIe report,
           conditions, power, recorder, …) built on the same tree, one poll cycle and one
           PCIe walk done; timed right after a new poll (the GPU block is rendered anew,
           the PCIe block is the one rendered at the last walk) and again with nothing new
Prints CPU µs per GPU-poll, the ratio gpuguard/raw, render ms and the body size.
Targets (issue 2): ratio ≤ 1.5, < 1 ms CPU per GPU-poll, render < 5 ms for 4 GPUs.

    python bench/poll_cost.py [--rounds N]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "daemon"))

from gpuguard.hw import amdgpu  # noqa: E402
from gpuguard.hw.sysfs import SysfsRoot  # noqa: E402
from gpuguard.sim.runner import build_scenario  # noqa: E402
from gpuguard.sim.tree import write_tree  # noqa: E402
from gpuguard.config.loader import parse_config  # noqa: E402
from gpuguard.daemon import Daemon  # noqa: E402


def cpu(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.process_time_ns()
        fn()
        out.append((time.process_time_ns() - t0) / 1e3)
    return out


def bench(scenario: str, rounds: int) -> dict:
    host = build_scenario(scenario)
    for i, bdf in enumerate(host.gpus):
        host.set_load(bdf, (i % 4) / 3)
    host.step(2.0)
    with tempfile.TemporaryDirectory(prefix="gpuguard-bench-") as d:
        write_tree(host, d)
        root = SysfsRoot(d)
        devs = amdgpu.discover(root)
        paths = [root.path(p) for dev in devs for p in dev.poll_paths()]

        def raw() -> None:
            for p in paths:
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.read(fd, 65536)
                finally:
                    os.close(fd)

        def poll() -> list:
            return [amdgpu.read_gpu(root, dev, dev.bdf) for dev in devs]

        snaps = poll()
        assert all(s.up and not s.errors for s in snaps), [s.errors for s in snaps if s.errors]
        # interleave so both see the same machine state; take medians
        raw_us, poll_us = [], []
        for _ in range(rounds):
            raw_us += cpu(raw, 1)
            poll_us += cpu(poll, 1)
        render_new, render_same, body = asyncio.run(render_cost(d, rounds))
        n = len(devs)
        return {
            "gpus": n,
            "files_per_gpu": len(paths) / n,
            "raw_us_per_gpu": statistics.median(raw_us) / n,
            "poll_us_per_gpu": statistics.median(poll_us) / n,
            "ratio": statistics.median(poll_us) / statistics.median(raw_us),
            "render_ms": statistics.median(render_new) / 1e3,
            "render_unchanged_ms": statistics.median(render_same) / 1e3,
            "metrics_bytes": body,
        }


async def render_cost(tree: str, rounds: int) -> tuple[list[float], list[float], int]:
    state = tempfile.mkdtemp(prefix="gpuguard-bench-state-")
    open(os.path.join(state, "kmsg"), "w").close()
    cfg = parse_config(f"""
sysfs_root: {tree}
state_dir: {state}
listen: {{address: 127.0.0.1, port: 0}}
kernel: {{kmsg_path: {state}/kmsg, udev: false}}
power: {{sampler: false}}
""")
    d = Daemon(cfg)
    try:
        await d.poller.poll_once()
        await d.pcie.check_once()
        new, same = [], []
        for _ in range(rounds):
            await d.poller.poll_once()  # a new snapshot, as every second
            d.power.on_cycle(d.hub.snapshot)
            new += cpu(d.metrics.render, 1)
            same += cpu(d.metrics.render, 1)
        return new, same, len(d.metrics.render())
    finally:
        d.poller.close()
        d.power.close()
        if d.recorder is not None:
            d.recorder.close()
        shutil.rmtree(state, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    print(f"{'GPUs':>4} {'files/GPU':>9} {'raw µs/GPU':>10} {'gpuguard µs/GPU':>15} {'ratio':>6} {'render ms':>9} "
          f"{'unchanged ms':>12} {'scrape KiB':>10}")
    for scenario in ("incident", "bench32"):
        r = bench(scenario, args.rounds)
        print(
            f"{r['gpus']:>4} {r['files_per_gpu']:>9.0f} {r['raw_us_per_gpu']:>10.1f} {r['poll_us_per_gpu']:>15.1f} "
            f"{r['ratio']:>6.2f} {r['render_ms']:>9.2f} {r['render_unchanged_ms']:>12.2f} {r['metrics_bytes'] / 1024:>10.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
