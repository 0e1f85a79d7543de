"""Which sensor the fast power sampler reads on each GPU, and how (hw/power_sampler.py).

amdgpu (hwmon, µW): `power1_input` where the card has it — the SMU's current socket power
(APUs; dGPUs on SMU 13.0.7/14.0.2 answer EOPNOTSUPP and the kernel hides the file) —
else `power1_average`, the firmware's AverageSocketPower: a short average, so the peaks
it shows at 20–50 Hz are lower than the millisecond transients a PSU reacts to. The
driver refetches the SMU metrics table when its copy is older than 1 ms, so reading faster
than the firmware updates only returns the same value again.

NVIDIA (NVML): the instantaneous power field (`NVML_FI_DEV_POWER_INSTANT` through
`nvmlDeviceGetFieldValues`) where the driver has it, else `nvmlDeviceGetPowerUsage`
(on recent drivers a 1 s average). Read only; gpuguard never sets anything through NVML.
"""
from __future__ import annotations

from typing import Any

from gpuguard.hw.amdgpu_files import parse_microwatts
from gpuguard.hw.power_sampler import PowerChannel
from gpuguard.hw.sysfs import SysfsRoot

# nvml.h: NVML_FI_DEV_POWER_AVERAGE 185, NVML_FI_DEV_POWER_INSTANT 186 (milliwatts)
NVML_FI_DEV_POWER_INSTANT = 186
NVML_SUCCESS = 0
# c_nvmlValue_t member per nvmlValueType_t
_VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def amdgpu_channel(root: SysfsRoot, dev: Any, name: str) -> PowerChannel | None:
    """The channel of one amdgpu device (`AmdGpuDevice`), None without a power sensor."""
    hw = getattr(dev, "hwmon_path", None)
    if not hw:
        return None
    for attr in ("power1_input", "power1_average"):
        path = f"{hw}/{attr}"
        if root.exists(path):
            held = root.held(path)  # read by the sampler's thread only, kept open
            read_held = held.read

            def read(path: str = path) -> float:
                return parse_microwatts(read_held(), path)

            return PowerChannel(name, dev.bdf, attr, path, read, close=held.close)
    return None


class NvmlFieldError(Exception):
    pass


def nvml_field_watts(fv: Any, what: str) -> float:
    """Watts from one `c_nvmlFieldValue_t` (milliwatts in the member its valueType names)."""
    ret = getattr(fv, "nvmlReturn", NVML_SUCCESS)
    if ret != NVML_SUCCESS:
        raise NvmlFieldError(f"{what}: nvmlReturn {ret}")
    member = _VALUE_FIELDS.get(getattr(fv, "valueType", 1), "uiVal")
    return float(getattr(fv.value, member)) / 1000.0


def nvml_channel(nvml: Any, dev: Any, name: str) -> PowerChannel | None:
    """The channel of one NVML device (`NvmlDevice`): the instantaneous field when one
    read of it succeeds, else the power-usage call; None when neither answers."""
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(dev.index)
    except Exception:  # noqa: BLE001 — no handle, no sampling; the poller reports the GPU
        return None
    fid = int(getattr(nvml, "NVML_FI_DEV_POWER_INSTANT", NVML_FI_DEV_POWER_INSTANT))
    where = f"nvmlDeviceGetFieldValues(NVML_FI_DEV_POWER_INSTANT) of {dev.bdf}"
    try:
        nvml_field_watts(nvml.nvmlDeviceGetFieldValues(handle, [fid])[0], where)
    except Exception:  # noqa: BLE001 — older driver: fall back to the averaged call
        pass
    else:
        def read_instant() -> float:
            return nvml_field_watts(nvml.nvmlDeviceGetFieldValues(handle, [fid])[0], where)

        return PowerChannel(name, dev.bdf, "nvml_power_instant", where, read_instant)
    try:
        nvml.nvmlDeviceGetPowerUsage(handle)
    except Exception:  # noqa: BLE001
        return None

    def read_usage() -> float:
        return nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0

    return PowerChannel(name, dev.bdf, "nvml_power_usage", f"nvmlDeviceGetPowerUsage of {dev.bdf}", read_usage)


def channel_for(source: Any, dev: Any, name: str) -> PowerChannel | None:
    """The channel of a device found by one of the poller's sources (hw/sources.py)."""
    if getattr(source, "name", None) == "amdgpu":
        return amdgpu_channel(source.root, dev, name)
    if getattr(source, "name", None) == "nvml":
        return nvml_channel(source.nvml, dev, name)
    return None
