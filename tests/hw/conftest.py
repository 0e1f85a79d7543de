"""Fixtures for hw tests: the reference manifest and small sysfs trees built in tmp dirs
from reference files (copied at test time into tmp, never into the repo), with the real
layout: sys/bus/pci/devices/<bdf> -> ../../../devices/pci0000:00/<port>/<bdf>, a `driver`
symlink, hwmon/hwmonN, drm/cardN, power/runtime_status."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def amdgpu_ref(reference: Path) -> Path:
    return reference / "amdgpu"


@pytest.fixture(scope="session")
def manifest(amdgpu_ref: Path) -> list[dict]:
    return json.loads((amdgpu_ref / "MANIFEST.json").read_text())


@dataclass
class HostTree:
    root: Path
    ref: Path
    manifest: list[dict]

    @property
    def sys(self) -> Path:
        return self.root / "sys"

    def device_dir(self, bdf: str) -> Path:
        return (self.sys / "bus/pci/devices" / bdf).resolve()

    def _pci(self, bdf: str, port: str, pci_class: str, ids: dict[str, str], driver: str | None) -> Path:
        dev = self.sys / "devices/pci0000:00" / port / bdf
        dev.mkdir(parents=True)
        (dev / "class").write_text(pci_class + "\n")
        for name, value in ids.items():
            (dev / name).write_text(value + "\n")
        if driver:
            drv = self.sys / "bus/pci/drivers" / driver
            drv.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(drv, dev), dev / "driver")
        links = self.sys / "bus/pci/devices"
        links.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(dev, links), links / bdf)
        return dev

    def add_other(self, bdf: str, pci_class: str, vendor: str, device: str, driver: str | None) -> Path:
        """A PCI device that is not an amdgpu GPU (bridge, NVIDIA, radeon-bound card)."""
        ids = {"vendor": vendor, "device": device, "subsystem_vendor": vendor, "subsystem_device": "0x0000", "revision": "0x00"}
        return self._pci(bdf, f"0000:00:1{len(list(self.sys.glob('devices/pci0000:00/*')))}.0", pci_class, ids, driver)

    def add_gpu(
        self,
        prefix: str,
        bdf: str,
        *,
        hwmon: int = 3,
        card: int = 1,
        port: str | None = None,
        runtime_status: str | None = "active",
        driver: str = "amdgpu",
        skip: tuple[str, ...] = (),
    ) -> Path:
        """A GPU whose device and hwmon files are the reference dump `prefix`."""
        ref = self.ref
        entries = [e for e in self.manifest if f"{e['gen']}-{e['model']}" == prefix]
        assert entries, f"no reference dump {prefix}"
        uevent = dict(
            line.split("=", 1) for line in (ref / f"{prefix}-uevent.txt").read_text().split("\n") if "=" in line
        )
        vendor, device = uevent["PCI_ID"].lower().split(":")
        sub_v, sub_d = uevent["PCI_SUBSYS_ID"].lower().split(":")
        ids = {
            "vendor": f"0x{vendor}",
            "device": f"0x{device}",
            "subsystem_vendor": f"0x{sub_v}",
            "subsystem_device": f"0x{sub_d}",
            "revision": "0xc8",
        }
        pci_class = "0x" + uevent["PCI_CLASS"].rjust(6, "0").lower()
        port = port or f"0000:00:0{1 + len(list(self.sys.glob('devices/pci0000:00/*')))}.0"
        dev = self._pci(bdf, port, pci_class, ids, driver)
        hw = dev / "hwmon" / f"hwmon{hwmon}"
        hw.mkdir(parents=True)
        for e in entries:
            kind, f = e["fname"], ref / e["file"]
            if kind in skip:
                continue
            if kind.startswith("hwmon-"):
                target = hw / kind[len("hwmon-") :]
            else:
                target = dev / kind.replace("-", "/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(f.read_bytes())
        (dev / "drm" / f"card{card}").mkdir(parents=True)
        (dev / "drm" / f"renderD{127 + card}").mkdir()
        if runtime_status is not None:
            (dev / "power").mkdir()
            (dev / "power/runtime_status").write_text(runtime_status + "\n")
        return dev

    def set_ppfeaturemask(self, value: str) -> None:
        p = self.sys / "module/amdgpu/parameters"
        p.mkdir(parents=True, exist_ok=True)
        (p / "ppfeaturemask").write_text(value + "\n")


@pytest.fixture
def host(tmp_path: Path, amdgpu_ref: Path, manifest: list[dict]) -> HostTree:
    return HostTree(tmp_path / "host", amdgpu_ref, manifest)
