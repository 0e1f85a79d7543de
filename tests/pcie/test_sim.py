"""The must-shows of issue 3 on gpuguard.sim's incident host (written as a plain tree),
and the faults the simulator injects: a lost GPU, AER errors, a chipset root port."""
from __future__ import annotations

import pytest

from gpuguard.hw.pcie import walk
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.policy.doctor import diagnose, exit_status
from gpuguard.sim.host import SimHost
from gpuguard.sim.topology import incident_spec
from gpuguard.sim.tree import write_tree

XTX = ("0000:aa:00.0", "0000:b0:00.0")
R9700 = ("0000:05:00.0", "0000:08:00.0")
SLOT = {"0000:aa:00.0": ("0000:a7:00.0", "0000:a8:00.0"), "0000:b0:00.0": ("0000:ad:00.0", "0000:ae:00.0")}


def sim_tree(tmp_path, **spec):
    host = SimHost(incident_spec(**spec))
    writer = write_tree(host, str(tmp_path / "sim"))
    return host, writer, SysfsRoot(str(tmp_path / "sim"))


def loaded(host, writer, bdfs):
    for b in bdfs:
        host.set_load(b, 1.0)
    host.step(1.0)
    writer.refresh()


def test_sim_incident_host_must_shows(tmp_path):
    host, writer, root = sim_tree(tmp_path)
    loaded(host, writer, XTX + R9700)
    rep = walk(root, {b: True for b in XTX + R9700})
    for bdf in XTX:
        link = rep.gpu(bdf).narrowest_link
        assert (link.upper, link.lower) == SLOT[bdf]
        assert (link.current_speed_gts, link.current_width) == (5.0, 16)
        assert (link.capable_speed_gts, link.capable_width) == (16.0, 16) and link.downgraded
        assert rep.gpu(bdf).bottleneck_bytes_per_second == pytest.approx(8.0e9)
        # Not the switch's internal virtual ports (their 5 GT/s are mirror values).
        blamed = {h.bdf for h in rep.gpu(bdf).hops if h.downgraded}
        assert blamed == set(SLOT[bdf])
    for bdf in R9700:
        g = rep.gpu(bdf)
        assert g.narrowest_link.upper == g.hops[0].bdf and g.hops[0].role == "root_port"
        assert g.narrowest_link.limited_by == g.hops[0].bdf
        assert (g.narrowest_link.current_speed_gts, g.narrowest_link.current_width) == (8.0, 16)
    assert rep.pair(*XTX).meet == "switch" and rep.pair(*XTX).at == "0000:a1:00.0"
    for a, b in [R9700] + [(r, x) for r in R9700 for x in XTX]:
        p = rep.pair(a, b)
        assert p.meet == "host_bridge" and p.host_bridge == "8086:6f00" and p.p2p == "no"
    assert rep.gpu(XTX[0]).large_bar is False and rep.gpu(R9700[0]).large_bar is True
    # The CLI's own busy source (gpu_busy_percent) sees the load the simulator applies.
    from gpuguard.cli.pcie import busy_map

    assert all(busy_map(root, False).get(b) for b in XTX)


def test_sim_xtx_in_x8_slots_halves_the_bandwidth(tmp_path):
    _, _, root = sim_tree(tmp_path, xtx_slot_width=8)
    g = walk(root).gpu(XTX[0])
    assert g.narrowest_link.current_width == 8
    assert g.bottleneck_bytes_per_second == pytest.approx(4.0e9)


def test_sim_chipset_root_port_without_atomics(tmp_path):
    _, _, root = sim_tree(tmp_path, chipset_gpu=True)
    rep = walk(root)
    chipset = [g for g in rep.gpus if g.root_port and g.root_port.vendor == "8086" and g.root_port.device == "8d10"]
    assert len(chipset) == 1
    assert not chipset[0].root_port_atomics.completes_32_64
    fs = diagnose(root, rep)
    assert any(f.level == "FAIL" and f.check == "atomics" and f.where.startswith(chipset[0].bdf) for f in fs)


def test_sim_aer_errors_and_a_lost_gpu(tmp_path):
    host, writer, root = sim_tree(tmp_path)
    host.aer_error("0000:a8:00.0", "BadTLP", 4)
    writer.refresh()
    rep = walk(root)
    hop = next(h for h in rep.gpu(XTX[0]).hops if h.bdf == "0000:a8:00.0")
    assert hop.aer["correctable"] == 4
    # INCIDENTS §1: the card falls off the bus; first its reads fail, then it is gone.
    host.lose_gpu(XTX[1])
    writer.refresh()
    rep = walk(root)
    diagnose(root, rep)  # never a crash
    host.step(1.0)
    writer.refresh()
    rep = walk(root)
    assert rep.gpu(XTX[1]) is None
    assert rep.pair(*XTX) is None and rep.gpu(XTX[0]).narrowest_link.lower == SLOT[XTX[0]][1]
    # Doctor knows a GPU is missing only from the config's expected links.
    from gpuguard.hw.pcie_expect import ExpectedLink

    fs = diagnose(root, rep, {XTX[1]: ExpectedLink(width=16)})
    assert exit_status(fs) == 2
    assert [f.what for f in fs if f.level == "FAIL"] == ["configured GPU not found (expected x16)"]
