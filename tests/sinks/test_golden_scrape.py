"""Goldens of the seeded incident host (INCIDENTS §4: 2x R9700 on CPU root ports, 2x 7900 XTX
behind a switch whose slot hop trained at Gen2): the whole /metrics scrape of a daemon after one
poll and one PCIe walk, and `gpuguard status --json`, each normalised by tests/golden.py and
compared whole. Beside each, values derived by hand, so the golden is not only "what it did
last time"."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

import gpuguard
from golden import check_golden, normalise_exposition, status_text
from gpuguard.config import parse_config
from gpuguard.daemon import Daemon
from gpuguard.sim.host import SimHost
from gpuguard.sim.tree import write_tree


SEED = 23
R9700_A, R9700_B, XTX_0, XTX_1 = "0000:05:00.0", "0000:08:00.0", "0000:aa:00.0", "0000:b0:00.0"
GPUS = f"""
gpus:
  - {{name: r9700-a, match: {{bdf: "{R9700_A}"}}}}
  - {{name: r9700-b, match: {{bdf: "{R9700_B}"}}}}
  - {{name: xtx-0, match: {{bdf: "{XTX_0}"}}}}
  - {{name: xtx-1, match: {{bdf: "{XTX_1}"}}}}
"""


@pytest.fixture
def incident_tree(tmp_path):
    """The seeded host with fixed inputs: r9700-a and xtx-0 fully loaded, 5 s simulated."""
    host = SimHost.incident(seed=SEED)
    host.set_load(R9700_A, 1.0)
    host.set_load(XTX_0, 1.0)
    host.step(5.0)
    write_tree(host, str(tmp_path / "root"))
    (tmp_path / "kmsg").write_text("")
    return tmp_path


def scrape(tmp) -> str:
    cfg = parse_config(f"""
sysfs_root: {tmp / 'root'}
state_dir: {tmp / 'state'}
listen: {{address: 127.0.0.1, port: 0}}
recorder: {{path: {tmp / 'state' / 'flight.sqlite'}}}
kernel: {{kmsg_path: {tmp / 'kmsg'}, udev: false, allow_userspace: false}}
power: {{psu_watts: 1600, sampler: false}}
""" + GPUS)  # the fast sampler's threads race the single poll: a fixed input needs it off

    async def main():
        d = Daemon(cfg)
        try:
            await d.poller.poll_once()
            await d.pcie.check_once()
            # the recorder commits on its own thread; a query runs after the queued writes,
            # so the rows counter is the cycle's, not a race with the commit
            d.recorder.query("SELECT 1")
            return d.metrics.render().decode()
        finally:
            d.poller.close()
            d.power.close()
            d.recorder.close()

    return asyncio.run(main())


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_whole_metrics_scrape_of_the_incident_host_matches_golden(incident_tree, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    text = scrape(incident_tree)
    check_golden("incident-host.metrics.txt", normalise_exposition(
        text, {str(incident_tree): "<tmp>", f'version="{gpuguard.__version__}"': 'version="<version>"'}))
    m = samples(text)

    def v(name, **labels):
        return m[(name, tuple(sorted(labels.items())))]

    # INCIDENTS §5: mem_info_vram_total 34208743424 = 32624 MiB, all of it CPU-visible (large BAR)
    assert v("gpuguard_gpu_vram_total_bytes", gpu="r9700-a") == 34208743424 == 32624 * 2**20
    assert v("gpuguard_gpu_vram_visible_bytes", gpu="r9700-a") == 34208743424
    # ... while the XTX exposes the 256 MiB legacy BAR
    assert v("gpuguard_gpu_vram_visible_bytes", gpu="xtx-0") == 256 * 2**20
    # power caps: the R9700's 300 W default and maximum; the XTX at 355 W (INCIDENTS §1)
    assert v("gpuguard_gpu_power_cap_watts", gpu="r9700-a") == 300.0 == v("gpuguard_gpu_power_cap_max_watts", gpu="r9700-a")
    assert v("gpuguard_gpu_power_cap_watts", gpu="xtx-0") == 355.0
    # INCIDENTS §4: the XTX slot hop runs 5 GT/s x16 where it could do 16 GT/s; 8b/10b
    # at Gen2 gives 5e9 * 16 lanes * 8/10 / 8 bits = 8.0 GB/s per direction
    slot = [dict(labels) for (name, labels), val in m.items()
            if name == "gpuguard_pcie_link_downgraded" and val == 1 and dict(labels)["gpu"] == "xtx-0"]
    assert slot, "no downgraded hop under xtx-0"
    lab = slot[0]
    gts = v("gpuguard_pcie_link_current_transfers_per_second", **lab)
    width = v("gpuguard_pcie_link_current_width", **lab)
    assert (gts, width) == (5e9, 16)
    assert gts * width * 8 / 10 / 8 == 8.0e9
    assert v("gpuguard_pcie_link_max_transfers_per_second", **lab) == 16e9
    # every collector answered
    for (name, labels), val in m.items():
        if name == "gpuguard_collector_success":
            assert val == 1.0, labels


def test_status_json_of_the_incident_host_matches_golden(incident_tree):
    cfg = incident_tree / "gpuguard.yaml"
    cfg.write_text(GPUS)
    r = subprocess.run([sys.executable, "-m", "gpuguard", "status", "--json", "--config", str(cfg),
                        "--sysfs-root", str(incident_tree / "root")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    check_golden("incident-host.status.json", status_text(doc))
    gpus = {g["name"]: g for g in doc["gpus"]}
    assert doc["summary"] == "4/4 GPUs up" and doc["missing"] == []
    assert gpus["r9700-b"]["vram_total_bytes"] == 32624 * 2**20
    assert gpus["r9700-a"]["power_cap_watts"] == 300.0
    assert gpus["r9700-a"]["od"]["ranges"]["vddgfx_offset_mv"] == [-200, 0]  # undervolt only (INCIDENTS §2)
    # the loaded cards draw more than the idle ones, and no card above its cap
    assert gpus["r9700-a"]["power_watts"] > gpus["r9700-b"]["power_watts"] + 100
    for g in gpus.values():
        assert g["power_watts"] <= g["power_cap_watts"] * 1.1
