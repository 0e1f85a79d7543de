"""The NVML calls gpuguard makes, as data: the one list the reader asks, the capture
records on a real card and the replay answers. Keeping it data (no pynvml import) lets
a capture run on a lent machine and a test on a CI box agree on every argument, so a
replayed call is the very call the real driver answered.

Constants are NVML's numeric values (nvml.h), written out because pynvml may be absent.
"""
from __future__ import annotations

# nvmlDeviceGetFieldValues ids (nvml.h NVML_FI_DEV_*), read in ONE call per poll: one
# driver round trip instead of one per value (a poll costs one call per card).
FIELDS: dict[str, int] = {
    "ecc_current": 1,
    "ecc_sbe_volatile": 3,
    "ecc_dbe_volatile": 4,
    "ecc_sbe_aggregate": 5,
    "ecc_dbe_aggregate": 6,
    "retired_sbe": 29,
    "retired_dbe": 30,
    "retired_pending": 31,
    # time-in-state counters (ns) of the clock-event reasons
    "violation_power_ns": 74,
    "violation_thermal_ns": 75,
    "violation_sync_boost_ns": 76,
    "violation_board_limit_ns": 77,
    "violation_low_util_ns": 78,
    "violation_reliability_ns": 79,
    "violation_sw_thermal_ns": 269,
    "violation_hw_thermal_ns": 270,
    "violation_power_brake_ns": 271,
    "memory_temp": 82,
    "energy_mj": 83,
    "nvlink_link_count": 91,
    "pcie_replay": 94,
    "pcie_replay_rollover": 95,
    "remapped_cor": 142,
    "remapped_unc": 143,
    "remapped_pending": 144,
    "remapped_failure": 145,
    "power_instant_mw": 186,
    "pcie_tx_bytes": 197,
    "pcie_rx_bytes": 198,
}
FIELD_IDS: list[int] = list(FIELDS.values())

# nvmlClocksEventReason* bits -> label (gpuguard_gpu_throttle{reason}); the names follow
# dcgm-exporter's DCGM_FI_DEV_CLOCK_THROTTLE_REASONS decoding.
THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "power_brake",
    0x100: "display_clocks",
}

# nvml.h enums used as arguments
TEMPERATURE_GPU = 0
THRESHOLD_SHUTDOWN, THRESHOLD_SLOWDOWN, THRESHOLD_MEM_MAX, THRESHOLD_GPU_MAX = 0, 1, 2, 3
CLOCK_GRAPHICS, CLOCK_SM, CLOCK_MEM, CLOCK_VIDEO = 0, 1, 2, 3
PCIE_UTIL_TX, PCIE_UTIL_RX = 0, 1
MEMORY_ERROR_CORRECTED, MEMORY_ERROR_UNCORRECTED = 0, 1
VOLATILE_ECC, AGGREGATE_ECC = 0, 1
NVLINK_MAX_LINKS = 18  # Hopper's link count; NVML answers beyond it with InvalidArgument

# nvmlEventType* bits
EVENT_SBE = 0x1
EVENT_DBE = 0x2
EVENT_PSTATE = 0x4
EVENT_XID = 0x8
EVENT_CLOCK = 0x10
EVENT_GPU_UNAVAILABLE = 0x4000
EVENT_RECOVERY_ACTION = 0x8000
# What gpuguard listens for: the critical ones. PState/clock changes are noise here.
EVENTS_WANTED = EVENT_SBE | EVENT_DBE | EVENT_XID | EVENT_GPU_UNAVAILABLE | EVENT_RECOVERY_ACTION


def discovery_calls() -> list[tuple[str, tuple]]:
    """Per device, once (after nvmlDeviceGetHandleByIndex): identity and constraints."""
    return [
        ("nvmlDeviceGetPciInfo", ()),
        ("nvmlDeviceGetName", ()),
        ("nvmlDeviceGetUUID", ()),
        ("nvmlDeviceGetPowerManagementLimitConstraints", ()),
        ("nvmlDeviceGetPowerManagementDefaultLimit", ()),
        ("nvmlDeviceGetNumFans", ()),
        ("nvmlDeviceGetTemperatureThreshold", (THRESHOLD_SHUTDOWN,)),
        ("nvmlDeviceGetTemperatureThreshold", (THRESHOLD_SLOWDOWN,)),
        ("nvmlDeviceGetTemperatureThreshold", (THRESHOLD_MEM_MAX,)),
        ("nvmlDeviceGetTemperatureThreshold", (THRESHOLD_GPU_MAX,)),
        ("nvmlDeviceGetMaxClockInfo", (CLOCK_SM,)),
        ("nvmlDeviceGetMaxClockInfo", (CLOCK_MEM,)),
        ("nvmlDeviceGetMaxClockInfo", (CLOCK_GRAPHICS,)),
        ("nvmlDeviceGetSupportedMemoryClocks", ()),
        ("nvmlDeviceGetDefaultApplicationsClock", (CLOCK_GRAPHICS,)),
        ("nvmlDeviceGetDefaultApplicationsClock", (CLOCK_MEM,)),
        ("nvmlDeviceGetSupportedClocksEventReasons", ()),
        ("nvmlDeviceGetSupportedEventTypes", ()),
        ("nvmlDeviceGetMemoryInfo", ()),
        ("nvmlDeviceGetBAR1MemoryInfo", ()),
        ("nvmlDeviceGetMaxPcieLinkGeneration", ()),
        ("nvmlDeviceGetMaxPcieLinkWidth", ()),
        ("nvmlDeviceGetEccMode", ()),
        ("nvmlDeviceGetPersistenceMode", ()),
    ] + [("nvmlDeviceGetNvLinkState", (link,)) for link in range(NVLINK_MAX_LINKS)]


def poll_calls() -> list[tuple[str, tuple]]:
    """Per device, every poll, in this order. Measured on the H200 (bench/results):
    nvmlDeviceGetPcieThroughput samples the link for 20 ms per call, so the byte counters
    come from the field values (fields 197/198) instead; energy (field 83) likewise
    replaces nvmlDeviceGetTotalEnergyConsumption (3 ms); ECC, retired pages and row
    remapping are fields too, so the whole health read is one call."""
    return [
        ("nvmlDeviceGetPowerUsage", ()),
        ("nvmlDeviceGetEnforcedPowerLimit", ()),
        ("nvmlDeviceGetTemperature", (TEMPERATURE_GPU,)),
        ("nvmlDeviceGetClockInfo", (CLOCK_SM,)),
        ("nvmlDeviceGetClockInfo", (CLOCK_MEM,)),
        ("nvmlDeviceGetUtilizationRates", ()),
        ("nvmlDeviceGetMemoryInfo", ()),
        ("nvmlDeviceGetPerformanceState", ()),
        ("nvmlDeviceGetCurrentClocksEventReasons", ()),
        ("nvmlDeviceGetFieldValues", (FIELD_IDS,)),
        ("nvmlDeviceGetCurrPcieLinkGeneration", ()),
        ("nvmlDeviceGetCurrPcieLinkWidth", ()),
        ("nvmlDeviceGetEncoderUtilization", ()),
        ("nvmlDeviceGetDecoderUtilization", ()),
        ("nvmlDeviceGetComputeRunningProcesses", ()),
    ]


def extra_capture_calls() -> list[tuple[str, tuple]]:
    """Recorded by the capture only (cross-checks for the tests, not polled): the
    per-type ECC counters and retired pages the field values also carry, the violation
    status the time-in-state fields also carry, and the application clocks."""
    return [
        ("nvmlDeviceGetTotalEnergyConsumption", ()),
        ("nvmlDeviceGetPcieThroughput", (PCIE_UTIL_TX,)),
        ("nvmlDeviceGetPcieThroughput", (PCIE_UTIL_RX,)),
        ("nvmlDeviceGetRemappedRows", ()),
        ("nvmlDeviceGetRetiredPagesPendingStatus", ()),
        ("nvmlDeviceGetTotalEccErrors", (MEMORY_ERROR_CORRECTED, VOLATILE_ECC)),
        ("nvmlDeviceGetTotalEccErrors", (MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC)),
        ("nvmlDeviceGetTotalEccErrors", (MEMORY_ERROR_CORRECTED, AGGREGATE_ECC)),
        ("nvmlDeviceGetTotalEccErrors", (MEMORY_ERROR_UNCORRECTED, AGGREGATE_ECC)),
        ("nvmlDeviceGetRetiredPages", (0,)),
        ("nvmlDeviceGetRetiredPages", (1,)),
        ("nvmlDeviceGetViolationStatus", (0,)),
        ("nvmlDeviceGetViolationStatus", (1,)),
        ("nvmlDeviceGetPcieReplayCounter", ()),
        ("nvmlDeviceGetApplicationsClock", (CLOCK_GRAPHICS,)),
        ("nvmlDeviceGetApplicationsClock", (CLOCK_MEM,)),
        ("nvmlDeviceGetClockInfo", (CLOCK_GRAPHICS,)),
        ("nvmlDeviceGetPowerManagementLimit", ()),
        ("nvmlDeviceGetCurrentClocksThrottleReasons", ()),
    ]
