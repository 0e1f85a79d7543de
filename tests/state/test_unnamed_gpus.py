"""A GPU without a configured name has one name whatever its vendor: its PCI address. The
recorded H200 (NVML replay) was called `card0000:00:06.0` — a `card` prefix glued to an
address, read as the DRM node `card0`, which it is not (gpuguard_gpu_info's `card` label
is the DRM node, cardN, and swaps between boots, INCIDENTS §8)."""
from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gpuguard.hw.nvml import NvmlSource
from gpuguard.hw.nvml_replay import NvmlTimeline
from gpuguard.hw.pcie import walk
from gpuguard.hw.sources import AmdgpuSource
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.poller import GpuPoller
from gpuguard.sim.host import SimHost
from gpuguard.sim.tree import write_tree
from gpuguard.sinks.metrics import MetricsSink
from gpuguard.sinks.pcie_metrics import samples
from gpuguard.state.hub import Hub
from gpuguard.state.identity import default_name

H200 = Path(__file__).resolve().parent.parent / "fixtures" / "h200" / "nvml-capture.json"
AMD = ("0000:05:00.0", "0000:08:00.0", "0000:aa:00.0", "0000:b0:00.0")
NVIDIA = "0000:00:06.0"  # the recorded H200's address


def test_unnamed_gpus_of_both_vendors_are_called_by_their_pci_address(tmp_path):
    host = SimHost.incident()
    write_tree(host, str(tmp_path / "sim"))
    root = SysfsRoot(str(tmp_path / "sim"))
    hub = Hub()
    poller = GpuPoller(hub, [AmdgpuSource(root), NvmlSource(NvmlTimeline.load(str(H200)))])
    try:
        snap = asyncio.run(poller.poll_once())
    finally:
        poller.close()
    every = sorted((*AMD, NVIDIA))
    assert default_name(NVIDIA) == NVIDIA
    # the state owner, the snapshot (status, the report's recording) and the summary
    assert hub.gpus.names() == {b: b for b in every}
    assert sorted((g.bdf, g.name) for g in snap.gpus) == [(b, b) for b in every]
    assert {g.vendor for g in snap.gpus} == {"1002", "10de"}
    # /metrics: the gpu label is the address for both vendors; `card` stays the DRM node
    text = MetricsSink(hub).render().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert sorted(s.labels["gpu"] for s in fams["gpuguard_gpu_up"].samples) == every
    info = {s.labels["gpu"]: s.labels for s in fams["gpuguard_gpu_info"].samples}
    assert info[AMD[0]]["bdf"] == AMD[0] and info[AMD[0]]["card"].startswith("card")
    assert not any(g.startswith("card") for g in info)
    # the PCIe block names an unnamed GPU the same way when the state owner has no name for it
    # (a hop shared by several GPUs names them all, comma-separated)
    pcie = {g for s in samples(walk(root)) if "gpu" in s.labels for g in s.labels["gpu"].split(",")}
    assert pcie == set(AMD)


def test_an_engine_names_an_unnamed_gpu_by_its_address_and_the_old_card_name_is_refused():
    import pytest

    from gpuguard.config import ConfigError
    from gpuguard.config.loader import parse_config

    engine = "engines:\n  - {name: qwen, kind: vllm, url: 'http://127.0.0.1:8000', process: {cmdline: 'vllm serve'}, gpus: [%s]}\n"
    ok = parse_config("gpus: [{name: xtx-0, match: {bdf: '0000:aa:00.0'}}]\n" + engine % "xtx-0, '0000:05:00.0'")
    assert ok.engines[0].gpus == ["xtx-0", "0000:05:00.0"]
    with pytest.raises(ConfigError) as e:
        parse_config(engine % "card0000:05:00.0")
    text = e.value.render()
    assert "card0000:05:00.0" in text and "'0000:05:00.0'" in text and "PCI address" in text
