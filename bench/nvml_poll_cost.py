"""Benchmark (not a test): cost of gpuguard's NVML poll against the same NVML calls made
directly from Python in a loop (issue 18).

  direct    the exact (function, arguments) sequence gpuguard's read made, recorded once,
            then called bare: `fn(*args)` in a loop, errors swallowed
  gpuguard  NvmlSource.read(dev) for every GPU (calls + decoding + immutable snapshot)

Wall and CPU medians per poll of all GPUs, interleaved rounds, ratio gpuguard/direct.
Target: ratio < 2. Measured on the lent H200 (bench/results/nvml-poll-h200-*.txt):
  before (15 calls: limits, thresholds and BAR1 every poll)  direct 649 µs, gpuguard 708 µs
  after  (16 calls: + health in one field-values call)       direct 5459 µs, gpuguard 5716 µs,
         ratio 1.05; 5.3 ms of it is the driver answering nvmlDeviceGetFieldValues (energy
         ~3 ms, thermal counters ~1 ms), the Python around it 0.26 ms.
In replay mode the CPU columns count the busy-wait that stands in for the driver.

    python bench/nvml_poll_cost.py --real            # on an NVIDIA host (pynvml, driver)
    python bench/nvml_poll_cost.py                   # replay of the H200 capture, each call
                                                     # taking the wall time it took there
    python bench/nvml_poll_cost.py --real --profile  # + cProfile of gpuguard's read
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "daemon"))

from gpuguard.hw.nvml import NvmlSource  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "h200",
                       "nvml-capture.json")


class _Tap:
    """Passes calls through to NVML, remembering (function, args) of each."""

    def __init__(self, n: Any) -> None:
        self._n = n
        self.seq: list[tuple[Any, tuple]] = []

    def __getattr__(self, attr: str) -> Any:
        target = getattr(self._n, attr)
        if not callable(target) or not attr.startswith("nvml"):
            return target

        def call(*args: Any) -> Any:
            self.seq.append((target, args))
            return target(*args)

        return call


def measure(nvml: Any, rounds: int, profile: bool) -> dict:
    tap = _Tap(nvml)
    src = NvmlSource(tap)
    devs = src.discover()
    for d in devs:  # first read: the limits read once per device, out of the figures
        src.read(d, "warm")
    tap.seq.clear()
    for d in devs:
        src.read(d, f"gpu{d.index}")
    seq = list(tap.seq)  # exactly what one steady-state poll asks NVML
    src.nvml = nvml  # the timed reader talks to NVML itself, not through the tap

    def direct() -> None:
        for fn, args in seq:
            try:
                fn(*args)
            except Exception:
                pass

    def poll() -> None:
        for d in devs:
            src.read(d, f"gpu{d.index}")

    walls: dict[str, list[float]] = {"direct": [], "gpuguard": []}
    cpus: dict[str, list[float]] = {"direct": [], "gpuguard": []}
    for _ in range(rounds):
        for name, fn in (("direct", direct), ("gpuguard", poll)):
            c0, w0 = time.process_time_ns(), time.perf_counter_ns()
            fn()
            walls[name].append((time.perf_counter_ns() - w0) / 1e3)
            cpus[name].append((time.process_time_ns() - c0) / 1e3)
    out = {
        "gpus": len(devs),
        "calls_per_poll": len(seq),
        "direct_wall_us": statistics.median(walls["direct"]),
        "gpuguard_wall_us": statistics.median(walls["gpuguard"]),
        "direct_cpu_us": statistics.median(cpus["direct"]),
        "gpuguard_cpu_us": statistics.median(cpus["gpuguard"]),
    }
    out["ratio_wall"] = out["gpuguard_wall_us"] / out["direct_wall_us"]
    if profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(rounds):
            poll()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(25)
        out["profile"] = s.getvalue()
    return out


def replay_with_latency(path: str) -> Any:
    """The capture's NVML, each answer delayed by the wall time the real call took."""
    from gpuguard.hw.nvml_replay import NvmlTimeline

    tl = NvmlTimeline.load(path, latency=True)
    tl.select(tl.indices("load")[5])  # mid-load: the clocks and the cap have settled
    return tl


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--real", action="store_true", help="the host's NVML (pynvml)")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", help="write the figures here too")
    a = ap.parse_args()
    if a.real:
        import pynvml

        pynvml.nvmlInit()
        nvml: Any = pynvml
    else:
        nvml = replay_with_latency(FIXTURE)
    r = measure(nvml, a.rounds, a.profile)
    print(f"{'GPUs':>4} {'calls':>5} {'direct µs':>10} {'gpuguard µs':>12} {'ratio':>6} "
          f"{'direct CPU µs':>13} {'gpuguard CPU µs':>15}")
    print(f"{r['gpus']:>4} {r['calls_per_poll']:>5} {r['direct_wall_us']:>10.0f} {r['gpuguard_wall_us']:>12.0f} "
          f"{r['ratio_wall']:>6.2f} {r['direct_cpu_us']:>13.0f} {r['gpuguard_cpu_us']:>15.0f}")
    if a.profile:
        print(r["profile"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
