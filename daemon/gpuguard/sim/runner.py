"""A running simulated host: named scenarios, a clock thread that steps the model in real
time, optional per-step hooks (the plain-tree refresher) and the control socket.

Scenarios: incident (INCIDENTS §4), incident-x8 (XTX pair in x8 slots), incident-chipset
(an extra R9700 on a PCH x4 root port without AtomicOps), incident-late (R9700 08:00.0
appears 5 s after start), incident-no-od (ppfeaturemask without 0x4000), incident-7.0
(Linux 7.0 era), bench32 (32 GPUs), amd-only-r9700 (the two R9700 only).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from .control import ControlServer
from .host import SimHost

SCENARIOS: dict[str, Callable[[int], SimHost]] = {
    "incident": lambda seed: SimHost.incident(seed=seed),
    "incident-x8": lambda seed: SimHost.incident(seed=seed, xtx_slot_width=8),
    "incident-chipset": lambda seed: SimHost.incident(seed=seed, chipset_gpu=True),
    "incident-late": lambda seed: _late(SimHost.incident(seed=seed)),
    "incident-no-od": lambda seed: SimHost.incident(seed=seed, od_enabled=False),
    "incident-7.0": lambda seed: SimHost.incident(seed=seed, era="7.0"),
    "incident-spare-slot": lambda seed: SimHost.incident(seed=seed, spare_slot=True),
    "bench32": lambda seed: SimHost.incident(seed=seed, extra_gpus=28),
    "amd-only-r9700": lambda seed: SimHost.incident(seed=seed, xtx=False),
}


# One line each, for `gpuguard sim scenarios`.
SCENARIO_HELP: dict[str, str] = {
    "incident": "INCIDENTS §4 host: 2x R9700 on CPU root ports, 2x 7900 XTX behind a switch whose slot hop trained at Gen2",
    "incident-x8": "as incident, with the XTX pair in x8 slots",
    "incident-chipset": "as incident, plus an R9700 on a chipset x4 root port without AtomicOps (INCIDENTS §6)",
    "incident-late": "as incident, with R9700 08:00.0 appearing 5 s after start (INCIDENTS §2: the late card)",
    "incident-no-od": "as incident, booted without OD in amdgpu.ppfeaturemask: profiles cannot apply",
    "incident-7.0": "as incident, with the Linux 7.0 era sysfs formats",
    "incident-spare-slot": "as incident, plus an empty hotplug slot (root port 00:03.2): `return_gpu(bdf, slot=...)` "
                           "brings a lost card back there, at 0000:42:00.0",
    "bench32": "the incident host plus 28 more GPUs (32 in all), for benchmarks",
    "amd-only-r9700": "the two R9700 only (INCIDENTS §2 host)",
}


def _late(host: SimHost) -> SimHost:
    host.add_late_gpu("0000:08:00.0", after_s=5.0)
    return host


def build_scenario(name: str, seed: int = 0) -> SimHost:
    try:
        return SCENARIOS[name](seed)
    except KeyError:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(sorted(SCENARIOS))}") from None


class SimRunner:
    def __init__(self, host: SimHost, interval: float = 0.5, control_socket: str | None = None,
                 on_step: Callable[[], None] | None = None, control_ops: dict[str, Callable] | None = None) -> None:
        self.host = host
        self.interval = interval
        self.on_step = on_step
        self.control = ControlServer(host, control_socket, control_ops) if control_socket else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sim-clock", daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            self.host.step(now - last)
            last = now
            if self.on_step:
                self.on_step()

    def start(self) -> "SimRunner":
        if self.control:
            self.control.start()
        if self.interval > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self.control:
            self.control.stop()
