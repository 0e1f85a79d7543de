"""A scrape's peak memory is the daemon's RSS from then on (freed Python objects go back to
arenas the process keeps), so /metrics renders one family at a time. At 32 GPUs the GPU
block (~2 000 samples) and the PCIe block (~3 000, 992 of them GPU-pair directions) were
built whole before rendering: 0.55 and 1.1 MiB at the peak for 72 and 207 KB of text
(issue 15). The bytes stay those of client_python's generate_latest over every family."""
from __future__ import annotations

import asyncio
import gc
import tracemalloc

import pytest
from prometheus_client import generate_latest

from gpuguard.hw.pcie import walk
from gpuguard.hw.sources import AmdgpuSource
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.poller import GpuPoller
from gpuguard.sim.host import SimHost
from gpuguard.sim.tree import write_tree
from gpuguard.sinks.metrics import MetricsSink, same_objects
from gpuguard.sinks.pcie_metrics import PcieCollector
from gpuguard.state.hub import Hub

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def host32(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bench32"))
    write_tree(SimHost.incident(extra_gpus=28), path)
    root = SysfsRoot(path)
    hub = Hub()
    poller = GpuPoller(hub, [AmdgpuSource(root)], interval=1, timeout=30)
    asyncio.run(poller.poll_once())
    poller.close()
    report = walk(root)
    sink = MetricsSink(hub)
    sink.add("pcie", PcieCollector(latest=lambda: report).collect, inputs=lambda: same_objects(report))
    assert len(hub.snapshot.gpus) == 32 and len(report.pairs) == 496
    return sink


def peak_of(render) -> tuple[bytes, int]:
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        body = render()
        return body, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_a_32_gpu_scrape_peaks_at_a_small_multiple_of_its_body(host32):
    host32.render()  # the first render claims the families
    for src in host32._sources.values():
        src.cached = None  # every block rendered again, as after a poll and a walk
    body, peak = peak_of(host32.render)
    assert len(body) > 250_000
    # built whole, the peak was 5.6x the body (1.6 MB); one family at a time 3.1x, of
    # which 2x is the blocks and the body they are joined into
    assert peak < 4 * len(body), f"render peaked at {peak} bytes for a {len(body)}-byte body"


def test_the_body_is_generate_latest_over_every_family(host32):
    families = list(host32._scrape())
    duration_and_success = {"gpuguard_collector_duration_seconds", "gpuguard_collector_success"}
    expected = generate_latest(type("R", (), {"collect": lambda self: [f for f in families
                                                                        if f.name not in duration_and_success]})())
    body = host32.render()
    head = body[: body.index(b"# HELP gpuguard_collector_duration_seconds")]
    assert head == expected
