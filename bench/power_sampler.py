"""Benchmark (not a test): CPU cost of the fast power sampler (hw/power_sampler.py).

Runs the real `PowerSampler` threads for N GPUs at 20 and 50 Hz for a few seconds each
and reports CPU % of one core per GPU: the process's CPU time over the run (all threads,
the samplers are the only ones working), and the samplers' own thread CPU time.

Sources:
  sim      (default) the incident host's R9700 `power1_average`, written as a plain sysfs
           tree (hwmon files of the simulator, parsed exactly as on a real host)
  hwmon    a real kernel sysfs file: the first /sys/class/hwmon/*/power1_{input,average},
           else any *_input there (the show() of a real driver; skipped when absent)
  nvml     the real NVML instantaneous power field (nvidia-ml-py and a driver)
Target (issue 17): ≤ 1 % of one core per GPU at 20 Hz for the sysfs path. Exit status 1
when the sim/hwmon figure at 20 Hz is above it.

    python bench/power_sampler.py [--seconds S] [--gpus N] [--source sim|hwmon|nvml|all]
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "daemon"))

from gpuguard.hw.power_sampler import PowerChannel, PowerSampler  # noqa: E402
from gpuguard.hw.power_sources import amdgpu_channel, nvml_channel  # noqa: E402
from gpuguard.hw.sysfs import SysfsRoot  # noqa: E402

TARGET_PCT = 1.0


def run(channels: list[PowerChannel], hz: float, seconds: float) -> dict:
    sampler = PowerSampler(hz=hz, ring_seconds=10, cpu_budget_ratio=1.0)  # no throttling while measuring
    c0, t0 = time.process_time(), time.monotonic()
    sampler.sync(channels)
    time.sleep(seconds)
    sampler.close()
    cpu, wall = time.process_time() - c0, time.monotonic() - t0
    n = len(channels)
    samples = sum(s.samples_total for s in sampler.samplers.values())
    errors = sum(s.errors_total for s in sampler.samplers.values())
    thread_cpu = sum(s.cpu_seconds for s in sampler.samplers.values())
    return {
        "gpus": n, "hz": hz, "seconds": round(wall, 2), "samples": samples, "errors": errors,
        "achieved_hz": round(samples / wall / n, 1),
        "cpu_pct_per_gpu": round(100 * cpu / wall / n, 3),
        "thread_cpu_pct_per_gpu": round(100 * thread_cpu / wall / n, 3),
        "us_per_sample": round(1e6 * cpu / max(samples, 1), 1),
    }


def sim_channels(n: int, tmp: str) -> list[PowerChannel]:
    from gpuguard.sim.host import SimHost
    from gpuguard.sim.tree import write_tree

    host = SimHost.incident(seed=1, extra_gpus=max(0, n - 4))
    for bdf in host.gpus:
        host.set_load(bdf, 1.0)
    host.step(1.0)
    write_tree(host, tmp)
    root = SysfsRoot(tmp)
    return [amdgpu_channel(root, SimpleNamespace(bdf=b, hwmon_path=host.hwmon_path(b)), f"gpu{i}")
            for i, b in enumerate(host.gpus[:n])]


def hwmon_channels(n: int) -> list[PowerChannel]:
    files = sorted(glob.glob("/sys/class/hwmon/*/power1_input") + glob.glob("/sys/class/hwmon/*/power1_average"))
    files = files or sorted(glob.glob("/sys/class/hwmon/*/*_input"))
    if not files:
        return []
    root = SysfsRoot("/")
    path = root.unroot(os.path.realpath(files[0]))

    def read(path: str = path) -> float:
        return int(root.read_bytes(path)) / 1e6

    # N channels on the same file: the cost per read is what is measured
    return [PowerChannel(f"gpu{i}", "-", os.path.basename(path), path, read) for i in range(n)]


def nvml_channels() -> list[PowerChannel]:
    try:
        import pynvml
        from gpuguard.hw.nvml import NvmlSource

        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001
        print(f"nvml: not available ({e})")
        return []
    src = NvmlSource(pynvml)
    return [c for d in src.discover() if (c := nvml_channel(pynvml, d, f"card{d.bdf}")) is not None]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--source", choices=("sim", "hwmon", "nvml", "all"), default="sim")
    args = ap.parse_args()
    failed = False
    with tempfile.TemporaryDirectory(prefix="gpuguard-bench-power-") as tmp:
        sources = {"sim": lambda: sim_channels(args.gpus, tmp), "hwmon": lambda: hwmon_channels(args.gpus),
                   "nvml": nvml_channels}
        for name in (sources if args.source == "all" else (args.source,)):
            channels = sources[name]()
            if not channels:
                print(f"{name}: no power source here, skipped")
                continue
            print(f"{name}: {len(channels)} channel(s), reading {channels[0].where} ({channels[0].source})")
            for hz in (20.0, 50.0):
                r = run(channels, hz, args.seconds)
                print(f"  {hz:>4g} Hz: {r}")
                if name in ("sim", "hwmon") and hz == 20.0 and r["cpu_pct_per_gpu"] > TARGET_PCT:
                    print(f"  ABOVE TARGET: {r['cpu_pct_per_gpu']} % > {TARGET_PCT} % of one core per GPU at 20 Hz")
                    failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
