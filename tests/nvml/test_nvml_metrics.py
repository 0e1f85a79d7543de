"""The NVIDIA health families on /metrics, from the H200 capture under load; checked
with promtool when it is installed."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from gpuguard.hw.nvml import NvmlSource, RecordedNvml
from gpuguard.hw.nvml_replay import NvmlTimeline
from gpuguard.sinks.metrics import MetricsSink
from gpuguard.state.hub import HostSnapshot, Hub

from .test_nvml_replay import FIXTURE as V1_ONLY, with_v2

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "h200"


def scrape(sample_phase: str = "load", capture: str = "nvml-capture.json") -> str:
    tl = NvmlTimeline.load(str(FIX / capture))
    src = NvmlSource(tl)
    (dev,) = src.discover()
    snap = None
    for i in tl.indices(sample_phase):
        tl.select(i)
        snap = src.read(dev, "h200")
    hub = Hub()
    hub.publish_snapshot(HostSnapshot(time=time.time(), gpus=(snap,)))
    return MetricsSink(hub).render().decode()


def value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in the scrape")


def test_throttle_energy_memory_temperature_on_metrics():
    text = scrape("load")
    assert value(text, 'gpuguard_gpu_throttle{gpu="h200",reason="sw_power_cap"}') == 1.0
    assert value(text, 'gpuguard_gpu_throttle{gpu="h200",reason="gpu_idle"}') == 0.0
    assert value(text, 'gpuguard_gpu_throttle_seconds_total{gpu="h200",reason="sw_power_cap"}') > 20
    assert value(text, 'gpuguard_gpu_energy_joules_total{gpu="h200"}') > 20000
    assert value(text, 'gpuguard_gpu_temperature_celsius{gpu="h200",sensor="mem"}') >= 45
    assert value(text, 'gpuguard_gpu_ecc_errors_total{gpu="h200",scope="volatile",type="uncorrected"}') == 0
    assert value(text, 'gpuguard_gpu_row_remap_failure{gpu="h200"}') == 0
    assert value(text, 'gpuguard_gpu_pcie_replays_total{gpu="h200"}') == 0
    assert value(text, 'gpuguard_gpu_nvml_unsupported{gpu="h200",reason="NVMLError_NotSupported",value="nvlink"}') == 1
    assert "gpuguard_gpu_retired_pages{" not in text  # the H200 has none: absent, not 0


def test_process_memory_on_metrics():
    text = scrape("load", "nvml-capture-short.json")
    assert value(text, 'gpuguard_gpu_process_vram_used_bytes{gpu="h200",pid="668"}') == 2795503616


def test_vram_used_and_reserved_on_metrics_as_nvidia_smi_reports_them():
    """Issue 14 on /metrics: the idle H200's 615 MiB driver reserve is its own series
    (DCGM_FI_DEV_FB_RESERVED), not counted in used (0, as nvidia-smi says)."""
    src = NvmlSource(RecordedNvml(with_v2(json.loads(V1_ONLY.read_text()))))
    (dev,) = src.discover()
    hub = Hub()
    hub.publish_snapshot(HostSnapshot(time=time.time(), gpus=(src.read(dev, "h200"),)))
    v = MetricsSink(hub).registry.get_sample_value
    assert v("gpuguard_gpu_vram_reserved_bytes", {"gpu": "h200"}) == 644939776
    assert v("gpuguard_gpu_vram_used_bytes", {"gpu": "h200"}) == 0
    assert v("gpuguard_gpu_vram_total_bytes", {"gpu": "h200"}) == 150754820096


def test_promtool_accepts_the_scrape(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    r = subprocess.run([promtool, "check", "metrics"], input=scrape("load").encode(), capture_output=True, timeout=60)
    # promtool lints (e.g. counters without _total) print on stdout/stderr; errors exit non-zero
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


def test_scrape_rendered_on_the_real_h200():
    """/metrics as gpuguard rendered it on the H200 with the real driver (pynvml, read
    only), idle and 8 s into a bf16 matmul load: kept byte for byte."""
    idle = (FIX / "metrics-h200-idle.txt").read_text()
    load = (FIX / "metrics-h200-load.txt").read_text()
    assert value(idle, 'gpuguard_gpu_throttle{gpu="h200",reason="gpu_idle"}') == 1.0
    assert value(load, 'gpuguard_gpu_throttle{gpu="h200",reason="sw_power_cap"}') == 1.0
    assert value(load, 'gpuguard_gpu_temperature_celsius{gpu="h200",sensor="mem"}') > value(
        idle, 'gpuguard_gpu_temperature_celsius{gpu="h200",sensor="mem"}')
    assert value(load, 'gpuguard_gpu_energy_joules_total{gpu="h200"}') > value(
        idle, 'gpuguard_gpu_energy_joules_total{gpu="h200"}')
    assert 'gpuguard_gpu_process_vram_used_bytes{gpu="h200",pid=' in load
    assert "gpuguard_poll_errors_total{" not in load  # nothing the card lacks counts as an error
    promtool = shutil.which("promtool")
    if promtool is not None:
        for text in (idle, load):
            r = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
            assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


def test_one_sink_scraped_across_polls_follows_the_nvml_values():
    """The NVML block is served as rendered while what it reads is the same (issue 15: on a
    host without NVIDIA cards every poll rendered the same empty block); each new reading
    of the H200 must still show."""
    tl = NvmlTimeline.load(str(FIX / "nvml-capture.json"))
    src = NvmlSource(tl)
    (dev,) = src.discover()
    hub = Hub()
    sink = MetricsSink(hub)
    energies = []
    for i in tl.indices("load")[:3]:
        tl.select(i)
        hub.publish_snapshot(HostSnapshot(time=time.time(), gpus=(src.read(dev, "h200"),)))
        text = sink.render().decode()
        energies.append(value(text, 'gpuguard_gpu_energy_joules_total{gpu="h200"}'))
    assert energies == sorted(energies) and len(set(energies)) == 3
    # the same reading in a new snapshot: the same text
    hub.publish_snapshot(HostSnapshot(time=time.time(), gpus=hub.snapshot.gpus))
    assert value(sink.render().decode(), 'gpuguard_gpu_energy_joules_total{gpu="h200"}') == energies[-1]
