"""Flight recorder size per GPU per day at the default poll interval (1 s): records one
hour of realistic cycles for 1 and 4 GPUs and extrapolates the pages in use to a day.

A default daemon writes, per cycle, the samples and, with the power sampler on (the
default), one `power_windows` row per GPU and one `power_host` row (policy/power_watch.py),
so both are written here; the samples-only figure is printed beside it.
Run: PYTHONPATH=daemon python3 bench/recorder_size.py"""
from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "daemon"))

from gpuguard.sinks.recorder import FlightRecorder  # noqa: E402
from gpuguard.state.hub import HostSnapshot  # noqa: E402
from gpuguard.state.snapshot import GpuSnapshot  # noqa: E402

HOUR = 3600


def cycle(t: float, n: int) -> HostSnapshot:
    gpus = tuple(
        GpuSnapshot(name=f"r9700-{i}", bdf=f"0000:0{5 + i}:00.0", vendor="1002", device_id="7551", driver="amdgpu",
                    model="R9700", card=f"card{i}", up=True, time=t, power_watts=261.5 + (t % 7),
                    power_cap_watts=300.0, temperatures={"edge": 51.0, "junction": 63.0 + (t % 3), "mem": 70.0},
                    clocks_hz={"sclk": 2.9e9, "mclk": 1.2e9}, fan_rpm=1450.0, busy_ratio=0.97,
                    vram_used_bytes=27 << 30)
        for i in range(n)
    )
    return HostSnapshot(time=t, gpus=gpus)


def power_rows(t: float, n: int) -> dict:
    # the rows policy/power_watch.py records each poll interval (same columns)
    return {
        "power_windows": [(t, f"r9700-{g}", f"0000:0{5 + g}:00.0", "power1_input", 20, 270.0 + g, 265.0, 261.5, 0)
                          for g in range(n)],
        "power_host": [(t, 270.0 * n, 261.5 * n, 150.0, 1300.0, 1105.0, 0)],
    }


def per_gpu_day(n: int, power: bool) -> float:
    with tempfile.TemporaryDirectory() as d:
        rec = FlightRecorder(os.path.join(d, "f.sqlite"), keep_seconds=1e9)
        fut = None
        for i in range(HOUR):
            t = 1.7e9 + i
            fut = rec.record(cycle(t, n))
            if power:
                fut = rec.record_power(power_rows(t, n))
        fut.result()
        used = rec._pool.submit(rec.used_bytes).result()
        rec.close()
    return used * 24 / n


def main() -> int:
    for n in (1, 4):
        full, samples = per_gpu_day(n, True), per_gpu_day(n, False)
        print(f"{n} GPU(s): {full / 1e6:.1f} MB per GPU per day at 1 s as the default daemon writes "
              f"(samples only: {samples / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
