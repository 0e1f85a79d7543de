"""Fault injection behaves like the kernel: lost GPUs, late GPUs, renumbered hwmon,
garbage, blocking reads, AER counters."""
from __future__ import annotations

import errno
import threading

import pytest


XTX = "0000:aa:00.0"
R9700 = "0000:08:00.0"


def err_of(fn, *a) -> int:
    with pytest.raises(OSError) as ei:
        fn(*a)
    return ei.value.errno


def test_lost_gpu_fails_reads_then_vanishes(incident):
    h = incident
    dev, card, hwmon = h.device_path(XTX), h.card_path(XTX), h.hwmon_path(XTX)
    hw_class = f"/sys/class/hwmon/{hwmon.rsplit('/', 1)[1]}"
    h.lose_gpu(XTX)
    assert err_of(h.read, f"{hwmon}/power1_average") == errno.EIO
    assert err_of(h.read, f"{dev}/gpu_busy_percent") == errno.EIO
    assert h.read(f"{dev}/config")[:4] == b"\xff\xff\xff\xff"
    assert h.read("/sys/bus/pci/devices/0000:a8:00.0/current_link_speed") == b"Unknown\n"
    assert h.read(f"{dev}/vendor") == b"0x1002\n"          # still bound: PCI core attrs cached
    other = h.hwmon_path("0000:b0:00.0")
    assert h.read(f"{other}/power1_average")               # the other GPUs keep answering
    assert "device lost from bus!" in h.kernel_log.records[-1].text
    h.step(0.5)
    for p in (dev, card, hwmon, hw_class, "/sys/bus/pci/devices/0000:aa:00.0",
              "/sys/bus/pci/devices/0000:a8:00.0", "/sys/bus/pci/drivers/amdgpu/0000:aa:00.0"):
        assert not h.exists(p), p
        assert err_of(h.read, p + "/uevent") == errno.ENOENT
    assert h.exists("/sys/bus/pci/devices/0000:a7:00.0")    # the switch port stays
    assert XTX not in h.gpus and len(h.gpus) == 3
    assert h.kernel_log.records[-1].text == "amdgpu 0000:aa:00.0: amdgpu: GPU Recovery Failed: -19"
    assert h.read(f"{other}/power1_average")


def test_lost_gpu_errno_is_selectable(incident):
    incident.lose_gpu(XTX, err=errno.ENODEV)
    assert err_of(incident.read, f"{incident.hwmon_path(XTX)}/temp1_input") == errno.ENODEV


def test_late_gpu_appears_with_all_links(incident):
    h = incident
    h.add_late_gpu(R9700, after_s=5.0)
    assert R9700 not in h.gpus
    assert not h.exists("/sys/bus/pci/devices/0000:08:00.0")
    assert not h.exists("/sys/bus/pci/devices/0000:06:00.0")
    drm_before = set(h.readdir("/sys/class/drm"))
    h.step(2.0)
    assert R9700 not in h.gpus
    h.step(3.5)
    assert R9700 in h.gpus
    card = h.card_path(R9700)
    assert card.rsplit("/", 1)[1] not in drm_before
    assert h.realpath(f"{card}/device") == h.device_path(R9700)
    hw = h.hwmon_path(R9700).rsplit("/", 1)[1]
    assert h.read(f"/sys/class/hwmon/{hw}/name") == b"amdgpu\n"
    assert h.realpath(f"/sys/bus/pci/drivers/amdgpu/{R9700}") == h.device_path(R9700)
    assert "Initialized amdgpu" in h.kernel_log.records[-1].text


def test_a_lost_card_comes_back_in_another_slot_at_new_addresses_with_its_own_identity():
    from gpuguard.sim.host import SimHost
    from gpuguard.sim.topology import SPARE_SLOT

    h = SimHost.incident(seed=7, spare_slot=True)
    dev = h.device_path(XTX)
    ident = {f: h.read(f"{dev}/{f}") for f in ("vendor", "device", "subsystem_vendor", "subsystem_device", "unique_id")}
    h.write(f"{dev}/pp_od_clk_voltage", b"s 1 1500\n")
    h.write(f"{dev}/pp_od_clk_voltage", b"c\n")
    assert h.read(f"/sys/bus/pci/devices/{SPARE_SLOT}/secondary_bus_number") == b"64\n"
    assert h.read(f"/sys/bus/pci/devices/{SPARE_SLOT}/subordinate_bus_number") == b"66\n"
    with pytest.raises(ValueError, match="lose it first"):
        h.return_gpu(XTX, slot=SPARE_SLOT)
    h.lose_gpu(XTX)
    h.step(0.5)
    new = h.return_gpu(XTX, slot=SPARE_SLOT)
    assert new == "0000:42:00.0" and new in h.gpus and XTX not in h.gpus
    for gone in (XTX, "0000:a9:00.0", "0000:a8:00.0"):  # the old slot is empty
        assert not h.exists(f"/sys/bus/pci/devices/{gone}")
    assert h.exists("/sys/bus/pci/devices/0000:a7:00.0")
    path = h.realpath(f"/sys/bus/pci/devices/{new}")
    assert path == f"/sys/devices/pci0000:00/{SPARE_SLOT}/0000:40:00.0/0000:41:00.0/{new}"
    assert {f: h.read(f"{path}/{f}") for f in ident} == ident  # the card's own identity files
    assert h.realpath(f"{h.card_path(new)}/device") == path
    assert "1500Mhz" not in h.read(f"{path}/pp_od_clk_voltage").decode().split("OD_MCLK")[0]  # stock
    assert h.read(f"{path}/current_link_speed") == b"16.0 GT/s PCIe\n"
    # the slot hop trains anew: the Gen3 root port, not the old slot's 5.0 GT/s (INCIDENTS §4)
    assert h.read("/sys/bus/pci/devices/0000:40:00.0/current_link_speed") == b"8.0 GT/s PCIe\n"
    texts = [r.text for r in h.kernel_log.records[-3:]]
    assert texts[1].startswith(f"pci {new}: [1002:744c] type 00 class 0x030000")
    assert texts[2].startswith(f"[drm] Initialized amdgpu") and new in texts[2]
    assert h.gpus == ["0000:05:00.0", "0000:08:00.0", new, "0000:b0:00.0"]  # PCI order
    with pytest.raises(ValueError, match="not empty"):
        h.lose_gpu(new)
        h.step(0.5)
        h.return_gpu(new, slot=SPARE_SLOT)


def test_a_slot_without_reserved_buses_refuses_a_hot_added_card(incident):
    incident.lose_gpu(XTX)
    incident.step(0.5)
    with pytest.raises(ValueError, match="No bus number available"):
        incident.return_gpu(XTX, slot="0000:00:01.0")


def test_appear_now(incident):
    incident.add_late_gpu(R9700)
    incident.appear(R9700)
    assert incident.read(f"{incident.device_path(R9700)}/device") == b"0x7551\n"


def test_card_and_hwmon_indices_are_not_pci_order(incident):
    h = incident
    cards = [int(h.card_path(b).rsplit("card", 1)[1]) for b in h.gpus]
    hwmons = [int(h.hwmon_path(b).rsplit("hwmon", 1)[1]) for b in h.gpus]
    assert cards != sorted(cards) and hwmons != sorted(hwmons) and cards != hwmons
    assert h.read("/sys/class/hwmon/hwmon0/name") == b"coretemp\n"


def test_renumber_hwmon(incident):
    h = incident
    before = {b: h.hwmon_path(b) for b in h.gpus}
    new = h.renumber_hwmon()
    for b in h.gpus:
        assert h.hwmon_path(b) != before[b]
        assert not h.exists(before[b])
        assert h.read(f"/sys/class/hwmon/hwmon{new[b]}/name") == b"amdgpu\n"
        assert h.realpath(f"/sys/class/hwmon/hwmon{new[b]}/device") == h.device_path(b)


def test_garbage_in_one_file(incident):
    h = incident
    hw = h.hwmon_path(XTX)
    h.garbage(XTX, "power1_average", "xyz\n")
    assert h.read(f"{hw}/power1_average") == b"xyz\n"
    assert h.read(f"{hw}/temp1_input").strip().isdigit()
    h.clear_garbage(XTX)
    assert h.read(f"{hw}/power1_average").strip().isdigit()


def test_blocked_read_hangs_until_released(incident):
    h = incident
    path = f"{h.hwmon_path(XTX)}/power1_average"
    h.block(XTX, "power1_average")
    got = []
    t = threading.Thread(target=lambda: got.append(h.read(path)), daemon=True)
    t.start()
    t.join(0.3)
    assert t.is_alive() and not got            # still hanging
    assert h.read(f"{h.hwmon_path(XTX)}/temp1_input")    # other files and the lock are free
    h.unblock(XTX)
    t.join(5)
    assert got and got[0].strip().isdigit()


def test_aer_counters(incident):
    h = incident
    h.aer_error("0000:a8:00.0", "BadTLP", 3)
    text = h.read("/sys/bus/pci/devices/0000:a8:00.0/aer_dev_correctable").decode()
    assert "BadTLP 3\n" in text and text.endswith("TOTAL_ERR_COR 3\n")
    assert h.read("/sys/bus/pci/devices/0000:a8:00.0/aer_dev_fatal").endswith(b"TOTAL_ERR_FATAL 0\n")
    rec = h.kernel_log.records[-1]
    assert rec.kmsg_line().startswith("4,") and "DEVICE=+pci:0000:a8:00.0" in rec.kmsg_line()
