"""Benchmark (not a test): cost of gpuguard's NVML poll against the same NVML calls made
directly from Python in a loop (issue 18).

  direct    the exact (function, arguments) sequence gpuguard's read made, recorded once,
            then called bare: `fn(*args)` in a loop, errors swallowed
  gpuguard  NvmlSource.read(dev) for every GPU (calls + decoding + immutable snapshot)

Wall and CPU medians per poll of all GPUs, interleaved rounds, ratio gpuguard/direct.
Target: ratio < 2.

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
    src = NvmlSource(nvml)
    devs = src.discover()
    src.read(devs[0], "warm")  # first-read setup (handles, constraints) out of the figures
    tap = _Tap(nvml)
    tapped = NvmlSource(tap)
    tapped._devices = getattr(src, "_devices", None)  # same cached state as the timed reader
    for d in devs:
        tapped.read(d, f"gpu{d.index}")
    seq = tap.seq

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

    return NvmlTimeline.load(path, sample=0, latency=True)


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
