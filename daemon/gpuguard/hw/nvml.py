"""NVIDIA GPUs through NVML (nvidia-ml-py, extra `nvidia`).

NVML is a C library bound to the real driver, so it is injected: `NvmlSource(nvml)` takes
the `pynvml` module on a real host, or a `RecordedNvml` that replays the answers captured
on a real machine (tests/fixtures/nvml/*.json, made with `python -m gpuguard.hw.nvml
--capture FILE`). Telemetry NVML says is "not supported" on a card (fans on a datacenter
GPU, voltage) is absent, not an error; any other NVML error is an error for that value.
A lost GPU (NVML_ERROR_GPU_IS_LOST) is `up=False`.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from gpuguard.state.snapshot import GpuSnapshot

# The calls gpuguard makes, in order. Capture records each; replay answers each.
READ_CALLS = (
    ("power_watts", "nvmlDeviceGetPowerUsage", 1e-3),
    ("power_cap_watts", "nvmlDeviceGetEnforcedPowerLimit", 1e-3),
    ("power_cap_default_watts", "nvmlDeviceGetPowerManagementDefaultLimit", 1e-3),
)

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


def normalise_bus_id(bus_id: str | bytes) -> str:
    """NVML's `00000000:19:00.0` → sysfs's `0000:19:00.0`."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode()
    domain, rest = bus_id.lower().split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def _err_name(e: BaseException) -> str:
    return type(e).__name__


class NvmlSource:
    name = "nvml"

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml

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

    def processes(self, dev: NvmlDevice) -> dict[int, int | None]:
        """pid -> GPU memory bytes (None when NVML does not say: NVML_VALUE_NOT_AVAILABLE,
        or no memory accounting in a container) of the compute and graphics processes on
        the GPU (issue 13: per-process attribution). Not supported = empty."""
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
        values: dict[str, Any] = {}
        lost = False

        def attempt(key: str, fn: Callable[[], Any]) -> Any:
            nonlocal lost
            try:
                return fn()
            except Exception as e:
                en = _err_name(e)
                if en in NOT_SUPPORTED_NAMES:
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
        for key, call, scale in READ_CALLS:
            v = attempt(key, lambda call=call: getattr(n, call)(h))
            values[key] = None if v is None else float(v) * scale
        # A passively cooled datacenter card (H200) has no fans; NVML then answers the RPM
        # query with InvalidArgument, so ask how many fans there are first.
        fans = attempt("fan_count", lambda: n.nvmlDeviceGetNumFans(h))
        if fans:
            rpm = attempt("fan_rpm", lambda: n.nvmlDeviceGetFanSpeedRPM(h))
            values["fan_rpm"] = None if rpm is None else float(getattr(rpm, "speed", rpm))
        cons = attempt("power_cap_limits", lambda: n.nvmlDeviceGetPowerManagementLimitConstraints(h))
        if cons is not None:
            values["power_cap_min_watts"], values["power_cap_max_watts"] = cons[0] / 1000.0, cons[1] / 1000.0
        temps: dict[str, float] = {}
        t = attempt("temperature_gpu", lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))
        if t is not None:
            temps["gpu"] = float(t)
        limits: dict[tuple[str, str], float] = {}
        for level, const in (("crit", "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN"), ("emergency", "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN")):
            v = attempt(f"temperature_limit_{level}", lambda const=const: n.nvmlDeviceGetTemperatureThreshold(h, getattr(n, const)))
            if v is not None:
                limits[("gpu", level)] = float(v)
        clocks: dict[str, float] = {}
        for domain, const in (("sclk", "NVML_CLOCK_SM"), ("mclk", "NVML_CLOCK_MEM")):
            v = attempt(f"clock_{domain}", lambda const=const: n.nvmlDeviceGetClockInfo(h, getattr(n, const)))
            if v is not None:
                clocks[domain] = float(v) * 1e6
        util = attempt("busy", lambda: n.nvmlDeviceGetUtilizationRates(h))
        mem = attempt("vram", lambda: n.nvmlDeviceGetMemoryInfo(h))
        bar1 = attempt("vram_visible", lambda: n.nvmlDeviceGetBAR1MemoryInfo(h))
        pstate = attempt("performance_level", lambda: n.nvmlDeviceGetPerformanceState(h))
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
            power_watts=values.get("power_watts"),
            power_cap_watts=values.get("power_cap_watts"),
            power_cap_min_watts=values.get("power_cap_min_watts"),
            power_cap_max_watts=values.get("power_cap_max_watts"),
            power_cap_default_watts=values.get("power_cap_default_watts"),
            temperatures=temps,
            temperature_limits=limits,
            clocks_hz=clocks,
            fan_rpm=values.get("fan_rpm"),
            busy_ratio=None if util is None else util.gpu / 100.0,
            vram_used_bytes=None if mem is None else int(mem.used),
            vram_total_bytes=None if mem is None else int(mem.total),
            # BAR1 is the CPU-visible window into VRAM on NVIDIA (large BAR when == VRAM).
            vram_visible_bytes=None if bar1 is None else int(bar1.bar1Total),
            performance_level=None if pstate is None else f"P{int(pstate)}",
            errors=errors,
            extra={"uuid": dev.uuid},
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
            key_args = [a if isinstance(a, (int, str)) else "h" for a in args]
            try:
                r = target(*args)
            except Exception as e:
                self.calls.append({"call": attr, "args": key_args, "error": _err_name(e), "message": str(e)})
                raise
            self.calls.append({"call": attr, "args": key_args, "result": _encode(r)})
            return r

        return call


def _encode(r: Any) -> Any:
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
        self._answers: dict[tuple, dict] = {}
        for c in capture["calls"]:
            self._answers.setdefault((c["call"], tuple(c["args"])), c)
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
            key = (attr, tuple(a if isinstance(a, (int, str)) else "h" for a in args))
            ans = self._answers.get(key)
            if ans is None:
                raise self._error("NVMLError_FunctionNotFound")(f"{attr}{key[1]} not in the capture")
            if "error" in ans:
                raise self._error(ans["error"])(ans.get("message", ""))
            return _decode(ans["result"])

        return call

    def _error(self, name: str) -> type:
        if name not in self._errors:
            self._errors[name] = type(name, (Exception,), {})
        return self._errors[name]


def capture(path: str) -> int:
    """Run discovery and one read of every GPU against the real NVML, recording answers.
    Read-only: gpuguard never sets anything through NVML."""
    import pynvml

    pynvml.nvmlInit()
    rec = _Recorder(pynvml)
    src = NvmlSource(rec)
    devs = src.discover()
    snaps = [src.read(d, f"card{d.bdf}").to_dict() for d in devs]
    processes = {d.bdf: {str(k): v for k, v in src.processes(d).items()} for d in devs}
    constants = {
        k: getattr(pynvml, k)
        for k in dir(pynvml)
        if k.startswith(("NVML_TEMPERATURE", "NVML_CLOCK_")) and isinstance(getattr(pynvml, k), int)
    }
    doc = {
        "driver_version": _encode(pynvml.nvmlSystemGetDriverVersion()),
        "nvml_version": _encode(pynvml.nvmlSystemGetNVMLVersion()),
        "constants": constants,
        "calls": rec.calls,
        "snapshots": snaps,
        "processes": processes,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    print(json.dumps(snaps, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--capture":
        raise SystemExit(capture(sys.argv[2]))
    print("usage: python -m gpuguard.hw.nvml --capture FILE", file=sys.stderr)
    raise SystemExit(2)
