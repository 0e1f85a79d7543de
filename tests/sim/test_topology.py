"""The incident topology of INCIDENTS §4 and its variants, as sysfs and config space show it."""
from __future__ import annotations

from gpuguard.sim.host import SimHost
from gpuguard.sim.pciconfig import parse_link


def chain(h: SimHost, bdf: str) -> list[str]:
    return [p for p in h.device_path(bdf).split("/") if p.startswith("0000:")]


def link(h, bdf):
    d = f"/sys/bus/pci/devices/{bdf}"
    return (h.read(f"{d}/current_link_speed"), h.read(f"{d}/current_link_width"),
            h.read(f"{d}/max_link_speed"), h.read(f"{d}/max_link_width"))


def test_incident_paths(incident):
    h = incident
    assert h.gpus == ["0000:05:00.0", "0000:08:00.0", "0000:aa:00.0", "0000:b0:00.0"]
    assert chain(h, "0000:05:00.0") == ["0000:00:02.0", "0000:03:00.0", "0000:04:00.0", "0000:05:00.0"]
    assert chain(h, "0000:08:00.0") == ["0000:00:03.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0"]
    assert chain(h, "0000:aa:00.0") == ["0000:a0:02.0", "0000:a1:00.0", "0000:a2:04.0", "0000:a7:00.0",
                                        "0000:a8:00.0", "0000:a9:00.0", "0000:aa:00.0"]
    assert chain(h, "0000:b0:00.0") == ["0000:a0:02.0", "0000:a1:00.0", "0000:a2:08.0", "0000:ad:00.0",
                                        "0000:ae:00.0", "0000:af:00.0", "0000:b0:00.0"]
    for hb in ("0000:00:00.0", "0000:a0:00.0"):
        assert h.read(f"/sys/bus/pci/devices/{hb}/device") == b"0x6f00\n"
        assert h.read(f"/sys/bus/pci/devices/{hb}/class") == b"0x060000\n"
    assert h.read("/sys/bus/pci/devices/0000:a1:00.0/device") == b"0xc010\n"
    assert h.read("/sys/bus/pci/devices/0000:03:00.0/device") == b"0x1478\n"
    assert h.read("/sys/bus/pci/devices/0000:04:00.0/device") == b"0x1479\n"
    assert h.read("/sys/bus/pci/devices/0000:aa:00.0/numa_node") == b"1\n"
    assert h.readlink("/sys/bus/pci/devices/0000:05:00.0/driver") == "../../../../../../bus/pci/drivers/amdgpu"
    assert h.realpath("/sys/bus/pci/devices/0000:a7:00.0/driver") == "/sys/bus/pci/drivers/pcieport"


def test_incident_links(incident):
    h = incident
    # R9700 on Gen3 root ports: limited by the root port, not downgraded.
    assert link(h, "0000:00:02.0") == (b"8.0 GT/s PCIe\n", b"16\n", b"8.0 GT/s PCIe\n", b"16\n")
    assert link(h, "0000:03:00.0") == (b"8.0 GT/s PCIe\n", b"16\n", b"32.0 GT/s PCIe\n", b"16\n")
    # The XTX slot hop trained at 5 GT/s with both ends 16 GT/s capable (INCIDENTS §4).
    for port, card in (("0000:a7:00.0", "0000:a8:00.0"), ("0000:ad:00.0", "0000:ae:00.0")):
        assert link(h, port)[0] == link(h, card)[0] == b"5.0 GT/s PCIe\n"
        assert link(h, port)[2] == link(h, card)[2] == b"16.0 GT/s PCIe\n"
    assert link(h, "0000:a2:04.0")[0] == b"5.0 GT/s PCIe\n"      # mirror values
    assert link(h, "0000:a9:00.0")[0] == b"16.0 GT/s PCIe\n"     # inside the card
    assert link(h, "0000:aa:00.0")[0] == b"16.0 GT/s PCIe\n"


def test_config_space_port_types_and_atomics(incident):
    h = SimHost.incident(chipset_gpu=True)
    rp = parse_link(h.read("/sys/bus/pci/devices/0000:00:02.0/config"))
    assert rp["port_type"] == 4 and rp["atomic_completer"] and rp["max_speed_code"] == 3
    up = parse_link(h.read("/sys/bus/pci/devices/0000:a8:00.0/config"))
    assert up["port_type"] == 5 and up["cur_speed_code"] == 2 and up["max_speed_code"] == 4
    gpu = parse_link(h.read("/sys/bus/pci/devices/0000:aa:00.0/config"))
    assert gpu["port_type"] == 0
    pch = parse_link(h.read("/sys/bus/pci/devices/0000:00:1c.0/config"))
    assert pch["port_type"] == 4 and not pch["atomic_completer"] and pch["max_width"] == 4
    cs = h.read("/sys/bus/pci/devices/0000:aa:00.0/config")
    assert len(cs) == 4096 and cs[:4] == bytes.fromhex("02104c74")


def test_variants():
    x8 = SimHost.incident(xtx_slot_width=8)
    assert x8.read("/sys/bus/pci/devices/0000:a8:00.0/current_link_width") == b"8\n"
    only = SimHost.incident(xtx=False)
    assert only.gpus == ["0000:05:00.0", "0000:08:00.0"]
    big = SimHost.incident(extra_gpus=28)
    assert len(big.gpus) == 32
    assert len({big.card_path(b) for b in big.gpus}) == 32
    assert len({big.hwmon_path(b) for b in big.gpus}) == 32
    # depth-first bus numbers: every bridge's secondary is above its own bus
    for f in big.functions:
        if f.secondary is not None:
            assert f.secondary > int(f.bdf.split(":")[1], 16) and f.subordinate >= f.secondary


def test_pp_dpm_pcie_follows_the_slot(incident):
    h = incident
    # R9700 behind a Gen3 root port: the SMU's PCIe levels are capped at the partner's 8 GT/s.
    r = h.read(f"{h.device_path('0000:05:00.0')}/pp_dpm_pcie")
    assert r == b"0: 2.5GT/s, x16 250Mhz \n1: 8.0GT/s, x16 1143Mhz *\n"
    # XTX whose slot trained at 5 GT/s: no level matches the running link, none is marked.
    x = h.read(f"{h.device_path('0000:aa:00.0')}/pp_dpm_pcie")
    assert x.count(b"16.0GT/s, x16") == 3 and b"*" not in x
