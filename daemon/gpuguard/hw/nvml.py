"""NVIDIA GPUs through NVML (nvidia-ml-py, extra `nvidia`).

NVML is a C library bound to the real driver, so it is injected: `NvmlSource(nvml)` takes
the `pynvml` module on a real host, or a replay of answers captured on a real machine:
`hw/nvml_replay.NvmlTimeline` for captures made with `python -m gpuguard.hw.nvml_capture`
(idle / load / after samples), `RecordedNvml` below for the older one-read captures.
Telemetry NVML says is "not supported" on a card (fans on a datacenter GPU, retired pages
on an H200) is absent and listed in `extra["nvml_unsupported"]` with the reason, not an
error; any other NVML error is an error for that value. A lost GPU
(NVML_ERROR_GPU_IS_LOST) is `up=False`. Limits that do not change while the driver is
loaded are read once per card; the health values (hw/nvml_health.py) are one
field-values call per poll.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from gpuguard.hw import nvml_calls as C
from gpuguard.hw.nvml_health import read_health
from gpuguard.hw.pci_address import normalise_bus_id
from gpuguard.state.identity import default_name
from gpuguard.state.snapshot import GpuSnapshot

NOT_SUPPORTED_NAMES = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")
LOST_NAMES = ("NVMLError_GpuIsLost", "NVMLError_Unknown")


@dataclass(frozen=True)
class NvmlDevice:
    index: int
    bdf: str
    vendor: str
    device_id: str
    model: str
    uuid: str
    driver: str = "nvidia"
    card: str | None = None


def _err_name(e: BaseException) -> str:
    return type(e).__name__


class NvmlSource:
    name = "nvml"

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self._statics: dict[str, dict[str, Any]] = {}  # uuid -> limits read once
        self._counters: dict[str, dict[str, Any]] = {}  # uuid -> wrapping counters' state

    @classmethod
    def open(cls) -> "NvmlSource | None":
        """The real NVML, or None when the library or driver is missing (no NVIDIA GPUs)."""
        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
        except Exception:
            return None
        return cls(pynvml)

    def discover(self) -> list[NvmlDevice]:
        n = self.nvml
        out = []
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            pci = n.nvmlDeviceGetPciInfo(h)
            bus_id = getattr(pci, "busIdLegacy", None) or pci.busId
            dev_vendor = int(pci.pciDeviceId)
            name = n.nvmlDeviceGetName(h)
            uuid = n.nvmlDeviceGetUUID(h)
            out.append(
                NvmlDevice(
                    index=i,
                    bdf=normalise_bus_id(bus_id),
                    vendor=f"{dev_vendor & 0xFFFF:04x}",
                    device_id=f"{dev_vendor >> 16:04x}",
                    model=name.decode() if isinstance(name, bytes) else str(name),
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                )
            )
        return out

    def vram_totals(self) -> dict[str, int]:
        """bdf -> VRAM bytes: NVIDIA exports no mem_info_* in sysfs, and the PCIe
        walker needs the size to judge large BAR."""
        out = {}
        for d in self.discover():
            try:
                out[d.bdf] = int(self.nvml.nvmlDeviceGetMemoryInfo(self.nvml.nvmlDeviceGetHandleByIndex(d.index)).total)
            except Exception:
                pass
        return out

    def _static(self, dev: NvmlDevice, h: Any) -> dict[str, Any]:
        """What does not change while the driver is loaded (limits, BAR1, supported
        reasons), read once per device instead of every poll: on the H200 BAR1 alone cost
        0.4 ms and the thresholds 0.2 ms each per poll (bench/results)."""
        st = self._statics.get(dev.uuid)
        if st is not None:
            return st
        n = self.nvml
        st = {"errors": {}, "unsupported": {}}

        def get(key: str, fn: Callable[[], Any]) -> Any:
            try:
                return fn()
            except Exception as e:
                en = _err_name(e)
                if en in NOT_SUPPORTED_NAMES:
                    st["unsupported"][key] = en
                else:
                    st["errors"][key] = f"NVML {key} of {dev.bdf}: {en}: {e}"
                return None

        st["power_cap_default"] = get("power_cap_default_watts", lambda: n.nvmlDeviceGetPowerManagementDefaultLimit(h))
        st["constraints"] = get("power_cap_limits", lambda: n.nvmlDeviceGetPowerManagementLimitConstraints(h))
        # A passively cooled datacenter card (H200) has no fans; NVML then answers the RPM
        # query with InvalidArgument, so ask how many fans there are first.
        st["fans"] = get("fan_count", lambda: n.nvmlDeviceGetNumFans(h))
        limits = {}
        for sensor, level, const in (("gpu", "crit", C.THRESHOLD_SLOWDOWN), ("gpu", "emergency", C.THRESHOLD_SHUTDOWN),
                                     ("mem", "crit", C.THRESHOLD_MEM_MAX)):
            v = get(f"temperature_limit_{sensor}_{level}", lambda const=const: n.nvmlDeviceGetTemperatureThreshold(h, const))
            if v is not None:
                limits[(sensor, level)] = float(v)
        st["temperature_limits"] = limits
        bar1 = get("vram_visible", lambda: n.nvmlDeviceGetBAR1MemoryInfo(h))
        st["bar1_total"] = None if bar1 is None else int(bar1.bar1Total)
        st["reasons_supported"] = get("throttle_supported", lambda: n.nvmlDeviceGetSupportedClocksEventReasons(h))
        self._statics[dev.uuid] = st
        return st

    def _memory(self, h: Any, attempt: Callable[[str, Callable[[], Any]], Any], unsupported: dict[str, str]) -> tuple[Any, int | None]:
        """(memory info, reserved bytes). NVML v2 (driver >= 510) reports `used` the way
        nvidia-smi does, without the driver's reserve (0 MiB on an idle H200, where v1
        says 615 MiB); the reserve is its own figure. Without v2, v1's `used` is all
        there is, and the reserve is unknown (named in errors), never a zero."""
        n = self.nvml
        v2 = getattr(n, "nvmlMemory_v2", None)
        if isinstance(v2, int):
            no_v2: list[bool] = []

            def read_v2() -> Any:
                try:
                    return n.nvmlDeviceGetMemoryInfo(h, v2)
                except TypeError:  # an nvidia-ml-py without the version argument
                    no_v2.append(True)
                except Exception as e:
                    if _err_name(e) not in NOT_SUPPORTED_NAMES:
                        raise
                    no_v2.append(True)
                return None

            mem = attempt("vram", read_v2)
            if not no_v2:
                return mem, None if mem is None else int(mem.reserved)
        mem = attempt("vram", lambda: n.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            # absent with the reason, like every value the card lacks: not a poll error
            # that would count every second on an older driver
            unsupported["vram_reserved"] = ("NVML has no v2 memory info here (driver < 510 or old nvidia-ml-py): "
                                       "VRAM used includes the driver's reserve")
        return mem, None

    def processes(self, dev: NvmlDevice) -> dict[int, int | None]:
        """pid -> GPU memory bytes (None when NVML does not say: NVML_VALUE_NOT_AVAILABLE,
        or no memory accounting in a container) of the compute and graphics processes on
        the GPU (per-process attribution). Not supported = empty."""
        n = self.nvml
        h = n.nvmlDeviceGetHandleByIndex(dev.index)
        out: dict[int, int | None] = {}
        for call in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                procs = getattr(n, call)(h)
            except Exception as e:
                if _err_name(e) in NOT_SUPPORTED_NAMES:
                    continue
                raise
            for p in procs or ():
                mem = getattr(p, "usedGpuMemory", None)
                # NVML_VALUE_NOT_AVAILABLE is (unsigned long long)-1
                out[int(p.pid)] = None if mem is None or int(mem) >= 2**64 - 1 else int(mem)
        return out

    def read(self, dev: NvmlDevice, name: str) -> GpuSnapshot:
        n = self.nvml
        errors: dict[str, str] = {}
        unsupported: dict[str, str] = {}
        lost = False

        def attempt(key: str, fn: Callable[[], Any]) -> Any:
            nonlocal lost
            try:
                return fn()
            except Exception as e:
                en = _err_name(e)
                if en in NOT_SUPPORTED_NAMES:
                    unsupported[key] = en
                    return None
                if en == "NVMLError_GpuIsLost":
                    lost = True
                errors[key] = f"NVML {key} of {dev.bdf}: {en}: {e}"
                return None

        h = attempt("handle", lambda: n.nvmlDeviceGetHandleByIndex(dev.index))
        if h is None:
            return GpuSnapshot(
                name=name, bdf=dev.bdf, vendor=dev.vendor, device_id=dev.device_id, driver="nvidia",
                model=dev.model, card=None, up=False, time=time.time(), errors=errors,
            )
        st = self._static(dev, h)
        errors.update(st["errors"])
        unsupported.update(st["unsupported"])
        power = attempt("power_watts", lambda: n.nvmlDeviceGetPowerUsage(h))
        cap = attempt("power_cap_watts", lambda: n.nvmlDeviceGetEnforcedPowerLimit(h))
        fan_rpm = None
        if st["fans"]:
            rpm = attempt("fan_rpm", lambda: n.nvmlDeviceGetFanSpeedRPM(h))
            fan_rpm = None if rpm is None else float(getattr(rpm, "speed", rpm))
        temps: dict[str, float] = {}
        t = attempt("temperature_gpu", lambda: n.nvmlDeviceGetTemperature(h, C.TEMPERATURE_GPU))
        if t is not None:
            temps["gpu"] = float(t)
        clocks: dict[str, float] = {}
        for domain, const in (("sclk", C.CLOCK_SM), ("mclk", C.CLOCK_MEM)):
            v = attempt(f"clock_{domain}", lambda const=const: n.nvmlDeviceGetClockInfo(h, const))
            if v is not None:
                clocks[domain] = float(v) * 1e6
        util = attempt("busy", lambda: n.nvmlDeviceGetUtilizationRates(h))
        mem, reserved = self._memory(h, attempt, unsupported)
        pstate = attempt("performance_level", lambda: n.nvmlDeviceGetPerformanceState(h))
        health = read_health(n, h, dev, attempt, st, self._counters.setdefault(dev.uuid, {}))
        unsupported.update(health.pop("_unsupported"))
        errors.update(health.pop("_errors"))
        if "memory_temp" in health:
            temps["mem"] = health.pop("memory_temp")
        cons = st["constraints"]
        default = st["power_cap_default"]
        return GpuSnapshot(
            name=name,
            bdf=dev.bdf,
            vendor=dev.vendor,
            device_id=dev.device_id,
            driver="nvidia",
            model=dev.model,
            card=None,
            up=not lost,
            time=time.time(),
            power_watts=None if power is None else power / 1000.0,
            power_cap_watts=None if cap is None else cap / 1000.0,
            power_cap_min_watts=None if cons is None else cons[0] / 1000.0,
            power_cap_max_watts=None if cons is None else cons[1] / 1000.0,
            power_cap_default_watts=None if default is None else default / 1000.0,
            temperatures=temps,
            temperature_limits=st["temperature_limits"],
            clocks_hz=clocks,
            fan_rpm=fan_rpm,
            busy_ratio=None if util is None else util.gpu / 100.0,
            vram_used_bytes=None if mem is None else int(mem.used),
            vram_total_bytes=None if mem is None else int(mem.total),
            vram_reserved_bytes=reserved,
            # BAR1 is the CPU-visible window into VRAM on NVIDIA (large BAR when == VRAM).
            vram_visible_bytes=st["bar1_total"],
            performance_level=None if pstate is None else f"P{int(pstate)}",
            errors=errors,
            # what this card lacks, with NVML's reason: absent, not an error (no storm)
            extra={"uuid": dev.uuid, "nvml": health, "nvml_unsupported": dict(sorted(unsupported.items()))},
        )


# -- capture and replay ---------------------------------------------------------------


class _Obj:
    def __init__(self, d: dict) -> None:
        self.__dict__.update(d)


class _Recorder:
    """Wraps pynvml; records every call's answer (or error class name) for replay."""

    def __init__(self, nvml: Any) -> None:
        self._n = nvml
        self.calls: list[dict] = []

    def __getattr__(self, attr: str) -> Any:
        target = getattr(self._n, attr)
        if not callable(target) or not attr.startswith("nvml"):
            return target

        def call(*args: Any) -> Any:
            key_args = [_arg_key(a) for a in args]
            try:
                r = target(*args)
            except Exception as e:
                self.calls.append({"call": attr, "args": key_args, "error": _err_name(e), "message": str(e)})
                raise
            self.calls.append({"call": attr, "args": key_args, "result": _encode(r)})
            return r

        return call


def _arg_key(a: Any) -> Any:
    """How an argument is keyed in a capture: ints and strings as they are, a list of field
    ids (nvmlDeviceGetFieldValues) as `fields:186,185`, anything else (a handle) as `h`."""
    if isinstance(a, (int, str)):
        return a
    if isinstance(a, (list, tuple)) and all(isinstance(x, int) for x in a):
        return "fields:" + ",".join(str(x) for x in a)
    return "h"


def _encode(r: Any) -> Any:
    import ctypes

    if isinstance(r, ctypes.Array):  # nvmlDeviceGetFieldValues answers an array of structs
        return [_encode(x) for x in r]
    if isinstance(r, bytes):
        return r.decode()
    if isinstance(r, (int, float, str)) or r is None:
        return r
    if isinstance(r, (list, tuple)):
        return [_encode(x) for x in r]
    fields = getattr(r, "_fields_", None)
    if fields:
        return {"__struct__": {f[0]: _encode(getattr(r, f[0])) for f in fields}}
    # pynvml hands process lists back as nvmlFriendlyObject (plain attributes, no _fields_)
    plain = {k: v for k, v in getattr(r, "__dict__", {}).items() if not k.startswith("_")}
    if plain:
        return {"__struct__": {k: _encode(v) for k, v in plain.items()}}
    return {"__handle__": True}


def _decode(r: Any) -> Any:
    if isinstance(r, dict) and "__struct__" in r:
        return _Obj({k: _decode(v) for k, v in r["__struct__"].items()})
    if isinstance(r, dict) and "__handle__" in r:
        return object()
    if isinstance(r, list):
        return tuple(_decode(x) for x in r)
    return r


class RecordedNvml:
    """Answers NVML calls from a capture made on a real host. Errors come back as
    exception classes with NVML's own names, so the reader's error handling is the one
    that runs on real hardware."""

    def __init__(self, capture: dict) -> None:
        self.constants = capture.get("constants", {})
        # A call recorded several times (the power sampler's) answers its recordings in
        # turn, round and round; a call recorded once always answers the same.
        self._answers: dict[tuple, list[dict]] = {}
        self._turn: dict[tuple, int] = {}
        for c in capture["calls"]:
            self._answers.setdefault((c["call"], tuple(c["args"])), []).append(c)
        self._errors: dict[str, type] = {}

    @classmethod
    def load(cls, path: str) -> "RecordedNvml":
        with open(path) as f:
            return cls(json.load(f))

    def __getattr__(self, attr: str) -> Any:
        if attr in self.constants:
            return self.constants[attr]
        if not attr.startswith("nvml"):
            raise AttributeError(attr)

        def call(*args: Any) -> Any:
            key = (attr, tuple(_arg_key(a) for a in args))
            answers = self._answers.get(key)
            if answers is None:
                raise self._error("NVMLError_FunctionNotFound")(f"{attr}{key[1]} not in the capture")
            turn = self._turn.get(key, 0)
            self._turn[key] = turn + 1
            ans = answers[turn % len(answers)]
            if "error" in ans:
                raise self._error(ans["error"])(ans.get("message", ""))
            return _decode(ans["result"])

        return call

    def _error(self, name: str) -> type:
        if name not in self._errors:
            self._errors[name] = type(name, (Exception,), {})
        return self._errors[name]


def capture(path: str, power_seconds: float = 0.0, power_hz: float = 50.0) -> int:
    """Run discovery and one read of every GPU against the real NVML, recording answers.
    Read-only: gpuguard never sets anything through NVML."""
    import pynvml

    pynvml.nvmlInit()
    rec = _Recorder(pynvml)
    src = NvmlSource(rec)
    devs = src.discover()
    snaps = [src.read(d, default_name(d.bdf)).to_dict() for d in devs]
    processes = {d.bdf: {str(k): v for k, v in src.processes(d).items()} for d in devs}
    constants = {
        k: getattr(pynvml, k)
        for k in dir(pynvml)
        if (k.startswith(("NVML_TEMPERATURE", "NVML_CLOCK_", "NVML_FI_DEV_POWER")) or k == "nvmlMemory_v2")
        and isinstance(getattr(pynvml, k), int)
    }
    doc = {
        "driver_version": _encode(pynvml.nvmlSystemGetDriverVersion()),
        "nvml_version": _encode(pynvml.nvmlSystemGetNVMLVersion()),
        "constants": constants,
        "calls": rec.calls,
        "snapshots": snaps,
        "processes": processes,
    }
    if power_seconds > 0:
        doc["power_sampling"] = sample_power(rec, devs, power_seconds, power_hz)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    print(json.dumps(snaps, indent=1))
    if "power_sampling" in doc:
        print(json.dumps(doc["power_sampling"], indent=1))
    return 0


def sample_power(nvml: Any, devs: list[NvmlDevice], seconds: float, hz: float) -> dict:
    """What the fast power sampler reads (hw/power_sources.nvml_channel), at its rate:
    the instantaneous field and the averaged call side by side. How often the hardware
    refreshes them is the median time between reads whose value changed (the field's
    timestamp is the read's, not the measurement's)."""
    import statistics

    from gpuguard.hw.power_sources import NVML_FI_DEV_POWER_INSTANT, nvml_channel, nvml_field_watts

    def update_interval_ms(series: list[tuple[int, float]]) -> float | None:
        changes = [t for (t, v), (_, prev) in zip(series[1:], series) if v != prev]
        steps = [b - a for a, b in zip(changes, changes[1:])]
        return statistics.median(steps) / 1000.0 if steps else None

    out = {}
    fid = int(getattr(nvml, "NVML_FI_DEV_POWER_INSTANT", NVML_FI_DEV_POWER_INSTANT))
    for d in devs:
        ch = nvml_channel(nvml, d, default_name(d.bdf))
        h = nvml.nvmlDeviceGetHandleByIndex(d.index)
        inst: list[tuple[int, float]] = []
        usage: list[tuple[int, float]] = []
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            fv = nvml.nvmlDeviceGetFieldValues(h, [fid])[0]
            stamp = int(getattr(fv, "timestamp", 0))
            try:
                inst.append((stamp, nvml_field_watts(fv, "instant")))
            except Exception:  # noqa: BLE001 — the driver's answer stays in the capture
                pass
            usage.append((stamp, nvml.nvmlDeviceGetPowerUsage(h) / 1000.0))
            time.sleep(1.0 / hz)
        iv, uv = [v for _, v in inst], [v for _, v in usage]
        out[d.bdf] = {
            "channel_source": ch.source if ch else None,
            "hz": hz, "samples": len(usage),
            "instant_watts": {"min": min(iv, default=None), "max": max(iv, default=None), "distinct": len(set(iv))},
            "usage_watts": {"min": min(uv, default=None), "max": max(uv, default=None), "distinct": len(set(uv))},
            "instant_update_interval_ms": update_interval_ms(inst),
            "usage_update_interval_ms": update_interval_ms(usage),
        }
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--capture":
        raise SystemExit(capture(sys.argv[2]))
    if len(sys.argv) in (3, 4) and sys.argv[1] == "--capture-power":
        # also samples the power sources for N seconds (default 3) at 50 Hz
        raise SystemExit(capture(sys.argv[2], float(sys.argv[3]) if len(sys.argv) == 4 else 3.0))
    print("usage: python -m gpuguard.hw.nvml --capture FILE | --capture-power FILE [SECONDS]", file=sys.stderr)
    raise SystemExit(2)
