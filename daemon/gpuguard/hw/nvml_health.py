"""NVIDIA health beyond telemetry, read through NVML in one poll: clock-event (throttle)
reasons with their time in state, memory temperature, total energy, ECC counts, retired
pages, row remapping, PCIe replays and byte counters, NVLink, video engines and
per-process GPU memory.

Almost all of it is ONE `nvmlDeviceGetFieldValues` call (hw/nvml_calls.FIELDS): each
field carries its own return code, so a field this card lacks (retired pages on an H200,
which remaps rows instead) is absent with NVML's reason, never an error per poll.

The result is a plain JSON-able dict (it goes into GpuSnapshot.extra["nvml"] and out
through the API as is); sinks/nvml_metrics.py turns it into Prometheus families.
"""
from __future__ import annotations

from typing import Any, Callable

from gpuguard.hw import nvml_calls as C

NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
# nvmlValueType_t -> the union member holding the value
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
# field -> width of the counter, for the ones NVML lets wrap (PCIe byte counters are
# 32-bit: the H200 showed 3.3e9 at idle, so they wrap every few seconds under traffic)
_WRAPS = {"pcie_tx_bytes": 1 << 32, "pcie_rx_bytes": 1 << 32}
# clock-event reason -> its time-in-state field (ns since driver load)
REASON_TIME_FIELDS = {
    "sw_power_cap": "violation_power_ns",
    "sync_boost": "violation_sync_boost_ns",
    "sw_thermal": "violation_sw_thermal_ns",
    "hw_thermal": "violation_hw_thermal_ns",
    "power_brake": "violation_power_brake_ns",
}


def decode_reasons(mask: int) -> list[str]:
    return [label for bit, label in C.THROTTLE_REASONS.items() if mask & bit]


def field_value(fv: Any) -> Any:
    """One nvmlFieldValue_t's value, by its declared type."""
    v = fv.value
    member = _VALUE_MEMBER.get(int(fv.valueType), "ullVal")
    return getattr(v, member)


def read_fields(values: Any) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """-> (values by name, unsupported name -> reason, errors name -> reason)."""
    names = {fid: name for name, fid in C.FIELDS.items()}
    out: dict[str, Any] = {}
    unsupported: dict[str, str] = {}
    errors: dict[str, str] = {}
    for fv in values or ():
        name = names.get(int(fv.fieldId))
        if name is None:
            continue
        ret = int(fv.nvmlReturn)
        if ret == NVML_SUCCESS:
            out[name] = field_value(fv)
        elif ret == NVML_ERROR_NOT_SUPPORTED:
            unsupported[f"field_{name}"] = "NVMLError_NotSupported"
        else:
            errors[f"field_{name}"] = f"NVML field {name} ({fv.fieldId}): return code {ret}"
    return out, unsupported, errors


def _unwrap(state: dict[str, Any], name: str, raw: int, width: int) -> int:
    """A wrapping hardware counter -> a total that only grows (since gpuguard started)."""
    last = state.get(name)
    total = state.get(name + "_total", 0)
    if last is not None:
        total += (raw - last) % width
    state[name], state[name + "_total"] = raw, total
    return total


def read_health(n: Any, h: Any, dev: Any, attempt: Callable[[str, Callable[[], Any]], Any],
                static: dict[str, Any], counters: dict[str, Any]) -> dict[str, Any]:
    unsupported: dict[str, str] = {}
    errors: dict[str, str] = {}
    out: dict[str, Any] = {}

    mask = attempt("throttle", lambda: n.nvmlDeviceGetCurrentClocksEventReasons(h))
    if mask is not None:
        mask = int(mask)
        supported = static.get("reasons_supported")
        out["throttle"] = {
            "mask": mask,
            "active": decode_reasons(mask),
            "supported": decode_reasons(int(supported)) if supported is not None else sorted(C.THROTTLE_REASONS.values()),
        }

    raw = attempt("fields", lambda: n.nvmlDeviceGetFieldValues(h, C.FIELD_IDS))
    f, fu, fe = read_fields(raw)
    unsupported.update(fu)
    errors.update(fe)
    if "memory_temp" in f:
        out["memory_temp"] = float(f["memory_temp"])
    if "energy_mj" in f:
        out["energy_joules"] = f["energy_mj"] / 1000.0
    times = {r: f[k] / 1e9 for r, k in REASON_TIME_FIELDS.items() if k in f}
    if times:
        out["throttle_seconds"] = times
    ecc = {k: int(f[fk]) for k, fk in (("enabled", "ecc_current"), ("corrected_volatile", "ecc_sbe_volatile"),
                                        ("uncorrected_volatile", "ecc_dbe_volatile"),
                                        ("corrected_aggregate", "ecc_sbe_aggregate"),
                                        ("uncorrected_aggregate", "ecc_dbe_aggregate")) if fk in f}
    if ecc:
        out["ecc"] = ecc
    retired = {k: int(f[fk]) for k, fk in (("sbe", "retired_sbe"), ("dbe", "retired_dbe"), ("pending", "retired_pending")) if fk in f}
    if retired:
        out["retired_pages"] = retired
    remap = {k: int(f[fk]) for k, fk in (("correctable", "remapped_cor"), ("uncorrectable", "remapped_unc"),
                                          ("pending", "remapped_pending"), ("failure", "remapped_failure")) if fk in f}
    if remap:
        out["row_remap"] = remap
    pcie: dict[str, Any] = {}
    if "pcie_replay" in f:
        pcie["replays"] = int(f["pcie_replay"])
    for name in ("pcie_tx_bytes", "pcie_rx_bytes"):
        if name in f:
            pcie[name.split("_", 1)[1] + "_total"] = _unwrap(counters, name, int(f[name]), _WRAPS[name])
    gen = attempt("pcie_link_gen", lambda: n.nvmlDeviceGetCurrPcieLinkGeneration(h))
    width = attempt("pcie_link_width", lambda: n.nvmlDeviceGetCurrPcieLinkWidth(h))
    if gen is not None:
        pcie["link_gen"] = int(gen)
    if width is not None:
        pcie["link_width"] = int(width)
    if pcie:
        out["pcie"] = pcie

    links = static.get("nvlink")
    if links is None:
        links = static["nvlink"] = _nvlink_links(n, h, f.get("nvlink_link_count"), static)
    if links:
        out["nvlink"] = {str(i): bool(attempt(f"nvlink_{i}", lambda i=i: n.nvmlDeviceGetNvLinkState(h, i))) for i in links}
    elif "nvlink" in static.get("unsupported", {}):
        unsupported["nvlink"] = static["unsupported"]["nvlink"]

    for key, call in (("encoder", "nvmlDeviceGetEncoderUtilization"), ("decoder", "nvmlDeviceGetDecoderUtilization")):
        r = attempt(f"{key}_busy", lambda call=call: getattr(n, call)(h))
        if r is not None:
            out[f"{key}_busy_ratio"] = r[0] / 100.0
    procs = attempt("processes", lambda: n.nvmlDeviceGetComputeRunningProcesses(h))
    if procs is not None:
        # NVML reports None (NOT_AVAILABLE) for a process's memory under some drivers/VMs
        out["processes"] = [
            {"pid": int(p.pid), "vram_used_bytes": None if getattr(p, "usedGpuMemory", None) is None else int(p.usedGpuMemory)}
            for p in procs if getattr(p, "pid", None) is not None
        ]
    out["_unsupported"] = unsupported
    out["_errors"] = errors
    return out


def _nvlink_links(n: Any, h: Any, count: Any, static: dict[str, Any]) -> list[int]:
    """The links this card has, asked once: a PCIe-only card (the lent H200) answers
    NotSupported for every link, and asking 18 links every poll would be 18 calls for
    nothing."""
    found = []
    reason = None
    for i in range(int(count) if count else C.NVLINK_MAX_LINKS):
        try:
            n.nvmlDeviceGetNvLinkState(h, i)
            found.append(i)
        except Exception as e:
            reason = type(e).__name__
            if not found and reason == "NVMLError_NotSupported":
                break
    if not found and reason:
        static.setdefault("unsupported", {})["nvlink"] = reason
    return found
