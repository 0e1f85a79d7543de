"""Prometheus families for the NVIDIA health gpuguard reads through NVML
(hw/nvml_health.py → GpuSnapshot.extra["nvml"]). The README's "NVIDIA hosts" section
maps each to the dcgm-exporter field NVIDIA owners know.

Only values the card gave appear; what it lacks is listed in
gpuguard_gpu_nvml_unsupported{gpu,value,reason} instead of a silent zero.
"""
from __future__ import annotations

from typing import Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


def nvml_families(snapshot: Any) -> Iterable[Metric]:
    def g(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=labels)

    def c(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=labels)

    throttle = g("gpuguard_gpu_throttle", "1 = this clock-event (throttle) reason is active now", ["gpu", "reason"])
    throttle_s = c("gpuguard_gpu_throttle_seconds", "Time spent throttled per reason since the driver loaded",
                   ["gpu", "reason"])
    energy = c("gpuguard_gpu_energy_joules", "Energy used since the driver loaded", ["gpu"])
    ecc_on = g("gpuguard_gpu_ecc_enabled", "1 = ECC active", ["gpu"])
    ecc = c("gpuguard_gpu_ecc_errors", "ECC errors; scope volatile = since driver load, aggregate = lifetime",
            ["gpu", "type", "scope"])
    retired = g("gpuguard_gpu_retired_pages", "Memory pages retired, per cause", ["gpu", "cause"])
    retired_pending = g("gpuguard_gpu_retired_pages_pending", "1 = pages wait for retirement (needs a reset)", ["gpu"])
    remapped = c("gpuguard_gpu_remapped_rows", "Memory rows remapped, per error type", ["gpu", "type"])
    remap_pending = g("gpuguard_gpu_row_remap_pending", "1 = a row remap waits for a GPU reset", ["gpu"])
    remap_failure = g("gpuguard_gpu_row_remap_failure", "1 = a row remap failed: the memory cannot heal (RMA)", ["gpu"])
    replays = c("gpuguard_gpu_pcie_replays", "PCIe replays (link retransmissions)", ["gpu"])
    tx = c("gpuguard_gpu_pcie_tx_bytes", "PCIe bytes sent by the GPU since gpuguard started", ["gpu"])
    rx = c("gpuguard_gpu_pcie_rx_bytes", "PCIe bytes received by the GPU since gpuguard started", ["gpu"])
    nvlink = g("gpuguard_gpu_nvlink_up", "1 = NVLink link active", ["gpu", "link"])
    enc = g("gpuguard_gpu_encoder_busy_ratio", "Video encoder busy, 0-1", ["gpu"])
    dec = g("gpuguard_gpu_decoder_busy_ratio", "Video decoder busy, 0-1", ["gpu"])
    procs = g("gpuguard_gpu_process_vram_used_bytes", "GPU memory used per process", ["gpu", "pid"])
    unsupported = g("gpuguard_gpu_nvml_unsupported", "A value this card or driver does not provide, with NVML's reason",
                    ["gpu", "value", "reason"])
    for gpu in getattr(snapshot, "gpus", ()) or ():
        h = gpu.extra.get("nvml")
        if not h:
            continue
        n = gpu.name
        t = h.get("throttle")
        if t:
            for reason in t["supported"]:
                throttle.add_metric([n, reason], 1.0 if reason in t["active"] else 0.0)
        for reason, s in sorted(h.get("throttle_seconds", {}).items()):
            throttle_s.add_metric([n, reason], s)
        if "energy_joules" in h:
            energy.add_metric([n], h["energy_joules"])
        e = h.get("ecc", {})
        if "enabled" in e:
            ecc_on.add_metric([n], e["enabled"])
        for key, v in sorted(e.items()):
            if key != "enabled":
                typ, scope = key.split("_", 1)
                ecc.add_metric([n, typ, scope], v)
        r = h.get("retired_pages", {})
        for cause in ("sbe", "dbe"):
            if cause in r:
                retired.add_metric([n, cause], r[cause])
        if "pending" in r:
            retired_pending.add_metric([n], r["pending"])
        rr = h.get("row_remap", {})
        for typ in ("correctable", "uncorrectable"):
            if typ in rr:
                remapped.add_metric([n, typ], rr[typ])
        if "pending" in rr:
            remap_pending.add_metric([n], rr["pending"])
        if "failure" in rr:
            remap_failure.add_metric([n], rr["failure"])
        p = h.get("pcie", {})
        if "replays" in p:
            replays.add_metric([n], p["replays"])
        if "tx_bytes_total" in p:
            tx.add_metric([n], p["tx_bytes_total"])
        if "rx_bytes_total" in p:
            rx.add_metric([n], p["rx_bytes_total"])
        for link, up in sorted(h.get("nvlink", {}).items(), key=lambda kv: int(kv[0])):
            nvlink.add_metric([n, link], 1.0 if up else 0.0)
        if "encoder_busy_ratio" in h:
            enc.add_metric([n], h["encoder_busy_ratio"])
        if "decoder_busy_ratio" in h:
            dec.add_metric([n], h["decoder_busy_ratio"])
        for proc in h.get("processes", ()):
            if proc.get("vram_used_bytes") is not None:
                procs.add_metric([n, str(proc["pid"])], proc["vram_used_bytes"])
        for value, reason in sorted(gpu.extra.get("nvml_unsupported", {}).items()):
            unsupported.add_metric([n, value, reason], 1.0)
    yield from (throttle, throttle_s, energy, ecc_on, ecc, retired, retired_pending, remapped, remap_pending,
                remap_failure, replays, tx, rx, nvlink, enc, dec, procs, unsupported)
