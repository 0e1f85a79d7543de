"""Flight recorder size per GPU per day at the default poll interval (1 s): records one
hour of realistic cycles for 1 and 4 GPUs and extrapolates the pages in use to a day.
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


def main() -> int:
    for n in (1, 4):
        with tempfile.TemporaryDirectory() as d:
            rec = FlightRecorder(os.path.join(d, "f.sqlite"), keep_seconds=1e9)
            futs = [rec.record(cycle(1.7e9 + i, n)) for i in range(HOUR)]
            futs[-1].result()
            used = rec._pool.submit(rec.used_bytes).result()
            rec.close()
        per_gpu_day = used * 24 / n
        print(f"{n} GPU(s): {used / 1e6:.2f} MB per hour in use -> {per_gpu_day / 1e6:.1f} MB per GPU per day at 1 s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
