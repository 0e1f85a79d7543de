"""PCI sysfs trees built in tmp dirs with the real layout: canonical device directories
under sys/devices/pci<domain>:<bus>/…, relative sys/bus/pci/devices symlinks, driver
symlinks, config files with a real capability list. `incident_host` is the INCIDENTS §4
topology (until gpuguard.sim lands)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuguard.hw.pcie_config import build_config

SPEED_CODE = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
PORT = {"endpoint": 0, "root_port": 4, "switch_upstream": 5, "switch_downstream": 6, "rc_endpoint": 9}
ALL_ATOMICS = 0x3C0  # Routing+ 32bit+ 64bit+ 128bitCAS+
GIB = 1 << 30
MIB = 1 << 20


def speed_text(gts: float) -> str:
    return f"{gts:.1f} GT/s PCIe"


def resource_text(bars: dict[int, tuple[int, int, int]], lines: int = 13) -> str:
    """bars: index -> (start, size, flags)."""
    out = []
    for i in range(lines):
        if i in bars:
            start, size, flags = bars[i]
            out.append(f"0x{start:016x} 0x{start + size - 1:016x} 0x{flags:016x}")
        else:
            out.append(f"0x{0:016x} 0x{0:016x} 0x{0:016x}")
    return "\n".join(out) + "\n"


MEM64_PREF = 0x14220C  # IORESOURCE_MEM | PREFETCH | MEM_64 | SIZEALIGN...
MEM32 = 0x40200


class PciTree:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.paths: dict[str, Path] = {}
        (base / "sys/bus/pci/devices").mkdir(parents=True, exist_ok=True)

    def add(
        self,
        bdf: str,
        parent: str,
        ids: str,
        cls: int,
        *,
        port: str | None = None,
        cur: tuple[float, int] | None = None,
        max: tuple[float, int] | None = None,
        driver: str | None = None,
        config: str = "full",  # full | truncated | none | garbage
        devcap2: int = 0,
        files: dict[str, str] | None = None,
        sysfs_link: bool = True,
    ) -> Path:
        """`parent` is a bdf already added or a root complex name (`pci0000:00`)."""
        if parent.startswith("pci"):
            path = self.base / "sys/devices" / parent / bdf
        else:
            path = self.paths[parent] / bdf
        path.mkdir(parents=True)
        self.paths[bdf] = path
        vendor, device = ids.split(":")
        (path / "vendor").write_text(f"0x{vendor}\n")
        (path / "device").write_text(f"0x{device}\n")
        (path / "class").write_text(f"0x{cls:06x}\n")
        (path / "numa_node").write_text("-1\n")
        if cur:
            (path / "current_link_speed").write_text(speed_text(cur[0]) + "\n")
            (path / "current_link_width").write_text(f"{cur[1]}\n")
        if max:
            (path / "max_link_speed").write_text(speed_text(max[0]) + "\n")
            (path / "max_link_width").write_text(f"{max[1]}\n")
        if config != "none":
            data = build_config(
                int(vendor, 16), int(device, 16), cls,
                header_type=1 if cls >> 8 == 0x0604 else 0,
                port_type=PORT[port] if port else None,
                max_speed=SPEED_CODE[max[0]] if max else 0, max_width=max[1] if max else 0,
                cur_speed=SPEED_CODE[cur[0]] if cur else 0, cur_width=cur[1] if cur else 0,
                devcap2=devcap2,
                size=64 if config == "truncated" else 4096,
            )
            if config == "garbage":  # a capability list that loops on itself
                buf = bytearray(data)
                buf[0x06], buf[0x34], buf[0x40], buf[0x41] = 0x10, 0x40, 0x01, 0x40
                data = bytes(buf)
            (path / "config").write_bytes(data)
        if driver:
            target = os.path.relpath(self.base / "sys/bus/pci/drivers" / driver, path)
            os.symlink(target, path / "driver")
        for name, text in (files or {}).items():
            f = path / name
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
        if sysfs_link:
            link = self.base / "sys/bus/pci/devices" / bdf
            os.symlink(os.path.relpath(path, link.parent), link)
        return path

    def set(self, bdf: str, name: str, text: str) -> None:
        (self.paths[bdf] / name).write_text(text)

    def remove(self, bdf: str, name: str) -> None:
        (self.paths[bdf] / name).unlink()


def amd_gpu_files(vram: int, visible: int, bar0: int, *, busy: int = 0, od: bool = True, cap_uw: int | None = 300_000_000) -> dict[str, str]:
    files = {
        "mem_info_vram_total": f"{vram}\n",
        "mem_info_vis_vram_total": f"{visible}\n",
        "gpu_busy_percent": f"{busy}\n",
        "resource": resource_text({0: (0x38000000000, bar0, MEM64_PREF), 2: (0x38800000000, 2 * MIB, MEM64_PREF),
                                   4: (0xe000, 0x100, 0x40101), 5: (0xfb000000, 0x100000, MEM32)}),
        "pp_dpm_pcie": "0: 2.5GT/s, x1 78Mhz \n1: 16.0GT/s, x16 623Mhz *\n",
    }
    if od:
        files["pp_od_clk_voltage"] = "OD_SCLK_OFFSET:\n0Mhz\n"
    if cap_uw is not None:
        files["hwmon/hwmon3/name"] = "amdgpu\n"
        files["hwmon/hwmon3/power1_cap"] = f"{cap_uw}\n"
    return files


def incident_host(
    tree: PciTree,
    *,
    xtx_slot_width: int = 16,
    xtx_slot_max_width: int = 16,
    mirror_speed: float = 5.0,
    root_devcap2: int = ALL_ATOMICS,
    xtx_busy: int = 100,
    config: str = "full",
) -> PciTree:
    """INCIDENTS §4: 2× R9700 on CPU root ports (Gen3 x16), 2× 7900 XTX behind a
    Broadcom PEX88096 (1000:c010) on root port a0:02.0, slot hop trained 5 GT/s."""
    t = tree
    t.add("0000:00:00.0", "pci0000:00", "8086:6f00", 0x060000, config=config)
    t.add("0000:a0:00.0", "pci0000:a0", "8086:6f00", 0x060000, config=config)
    gen3, gen4 = (8.0, 16), (16.0, 16)
    r9700 = amd_gpu_files(34208743424, 34208743424, 32 * GIB)
    for rp, up, down, gpu in (
        ("0000:00:02.0", "0000:03:00.0", "0000:04:00.0", "0000:05:00.0"),
        ("0000:00:03.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0"),
    ):
        t.add(rp, "pci0000:00", "8086:6f04", 0x060400, port="root_port", cur=gen3, max=gen3,
              driver="pcieport", devcap2=root_devcap2, config=config)
        t.add(up, rp, "1002:1478", 0x060400, port="switch_upstream", cur=gen3, max=gen4, driver="pcieport", config=config)
        t.add(down, up, "1002:1479", 0x060400, port="switch_downstream", cur=gen4, max=gen4, driver="pcieport", config=config)
        t.add(gpu, down, "1002:7551", 0x030000, port="endpoint", cur=gen4, max=gen4, driver="amdgpu",
              files=r9700, config=config)
    t.add("0000:a0:02.0", "pci0000:a0", "8086:6f04", 0x060400, port="root_port", cur=gen3, max=gen3,
          driver="pcieport", devcap2=root_devcap2, config=config,
          files={"aer_dev_correctable": "RxErr 0\nBadTLP 2\nBadDLLP 1\nTOTAL_ERR_COR 3\n",
                 "aer_dev_fatal": "Undefined 0\nDLP 0\nTOTAL_ERR_FATAL 0\n",
                 "aer_dev_nonfatal": "Undefined 0\nDLP 0\nTOTAL_ERR_NONFATAL 0\n"})
    t.add("0000:a1:00.0", "0000:a0:02.0", "1000:c010", 0x060400, port="switch_upstream", cur=gen3, max=gen4,
          driver="pcieport", config=config)
    mirror = (mirror_speed, 16)
    xtx = amd_gpu_files(25753026560, 268435456, 256 * MIB, busy=xtx_busy)
    for internal_down, internal_up, sw_down, card_up, card_down, gpu in (
        ("0000:a2:04.0", "0000:a3:00.0", "0000:a7:00.0", "0000:a8:00.0", "0000:a9:00.0", "0000:aa:00.0"),
        ("0000:a2:08.0", "0000:ab:00.0", "0000:ad:00.0", "0000:ae:00.0", "0000:af:00.0", "0000:b0:00.0"),
    ):
        # INCIDENTS §4: the switch's internal virtual ports report mirror values.
        t.add(internal_down, "0000:a1:00.0", "1000:c010", 0x060400, port="switch_downstream", cur=mirror, max=gen4,
              driver="pcieport", config=config)
        t.add(internal_up, internal_down, "1000:c010", 0x060400, port="switch_upstream", cur=mirror, max=gen4,
              driver="pcieport", config=config)
        slot_cur, slot_max = (5.0, xtx_slot_width), (16.0, xtx_slot_max_width)
        t.add(sw_down, internal_up, "1000:c010", 0x060400, port="switch_downstream", cur=slot_cur, max=slot_max,
              driver="pcieport", config=config)
        t.add(card_up, sw_down, "1002:1478", 0x060400, port="switch_upstream", cur=slot_cur, max=gen4,
              driver="pcieport", config=config)
        t.add(card_down, card_up, "1002:1479", 0x060400, port="switch_downstream", cur=gen4, max=gen4,
              driver="pcieport", config=config)
        t.add(gpu, card_down, "1002:744c", 0x030000, port="endpoint", cur=gen4, max=gen4, driver="amdgpu",
              files=xtx, config=config)
        t.add(gpu[:-1] + "1", card_down, "1002:ab30", 0x040300, port="endpoint", cur=gen4, max=gen4,
              driver="snd_hda_intel", config=config)
    # The BMC's VGA is a display, not a GPU.
    t.add("0000:00:1c.0", "pci0000:00", "8086:8d10", 0x060400, port="root_port", cur=(2.5, 1), max=(5.0, 1), config=config)
    t.add("0000:02:00.0", "0000:00:1c.0", "1a03:1150", 0x060400, config=config)
    t.add("0000:02:01.0", "0000:02:00.0", "1a03:2000", 0x030000, driver="ast", config=config)
    return t


XTX = ("0000:aa:00.0", "0000:b0:00.0")
R9700 = ("0000:05:00.0", "0000:08:00.0")


@pytest.fixture
def pci_tree(tmp_path):
    return PciTree(tmp_path / "host")


@pytest.fixture
def incident(pci_tree):
    return incident_host(pci_tree)


@pytest.fixture
def build_incident(tmp_path):
    counter = iter(range(1000))

    def build(**kw):
        return incident_host(PciTree(tmp_path / f"host{next(counter)}"), **kw)

    return build


@pytest.fixture
def make_tree(tmp_path):
    """A factory of further empty trees in the same test."""
    counter = iter(range(1000))
    return lambda: PciTree(tmp_path / f"tree{next(counter)}")
