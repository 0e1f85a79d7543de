"""The one PCI-address module (issue 14: five regexes had grown across the code): one
grammar for parsing and finding — a domain of 4 hex digits or more (VMD), a device number
0..1f, a function 0..7 — and one spelling out (sysfs's)."""
from __future__ import annotations

import pytest

from gpuguard.hw.pci_address import (
    addresses_in, bdf_in_path, host_bridge, is_canonical, normalise_bdf, normalise_bus_id, parse_bdf, parse_pci_id,
)


@pytest.mark.parametrize("text,want", [
    ("0000:05:00.0", "0000:05:00.0"), ("05:00.0", "0000:05:00.0"), (" 0000:AA:00.0 ", "0000:aa:00.0"),
    ("10000:e1:00.1", "10000:e1:00.1"),  # VMD domains print more than four digits
    ("0000:05:1f.7", "0000:05:1f.7"),  # the highest device and function
    ("00000000:19:00.0", "0000:19:00.0"),  # NVML's 8-digit domain is sysfs's 4
])
def test_parse_bdf(text, want):
    assert parse_bdf(text) == want and is_canonical(want)


@pytest.mark.parametrize("bad", ["0000:zz:00.0", "5:00.0", "0000:05:00.8", "card0", "", "1500.0", "000:05:00.0"])
def test_parse_bdf_refuses_with_the_value_named(bad):
    with pytest.raises(ValueError, match="is not a PCI address like 0000:05:00.0"):
        parse_bdf(bad)


@pytest.mark.parametrize("bad,why", [
    ("0000:05:ff.0", "device ff is above 1f"), ("05:20.0", "device 20 is above 1f"),
    ("0000:05:00.8", "function 8 is above 7"), ("000:05:00.0", "domain has 4 hex digits or more"),
])
def test_parse_bdf_says_which_field_is_out_of_range(bad, why):
    with pytest.raises(ValueError, match=f"'{bad}' is not a PCI address.*{why}"):
        parse_bdf(bad)


def test_nvml_bus_ids_take_sysfs_spelling():
    assert normalise_bus_id("00000000:00:06.0") == "0000:00:06.0"
    assert normalise_bus_id(b"00000001:3B:00.0") == "0001:3b:00.0"
    assert normalise_bus_id("00010000:E1:00.0") == "10000:e1:00.0"  # a VMD domain keeps its fifth digit
    with pytest.raises(ValueError, match="'00000000:19:ff.0' is not a PCI address"):
        normalise_bus_id("00000000:19:ff.0")


def test_vmd_domains_in_text_paths_and_root_buses():
    """VMD puts NVMe and GPUs in domains like 10000 (5 hex digits) on real hosts."""
    assert addresses_in("amdgpu 10000:e1:00.0: amdgpu: GPU reset begin!") == ["10000:e1:00.0"]
    assert addresses_in("NVRM: GPU at PCI:10000:e1:00: GPU-1234") == ["10000:e1:00.0"]
    assert bdf_in_path("/devices/pci0000:00/0000:00:0e.0/pci10000:e0/10000:e0:1d.0/10000:e1:00.0") == "10000:e1:00.0"
    assert host_bridge("pci10000:e0") == "10000:e0:00.0" and host_bridge("pci0000:00") == "0000:00:00.0"
    assert host_bridge("0000:00:0e.0") is None


def test_text_finder_and_parser_agree_on_the_grammar():
    """What the finder returns, the parser accepts; what the parser refuses, the finder skips."""
    line = "pcieport 0000:a0:02.0: AER: 10000:e1:00.0 0000:05:ff.0 0000:05:00.8 000:05:00.0 a1:00.0"
    found = addresses_in(line)
    assert found == ["0000:a0:02.0", "10000:e1:00.0", "0000:a1:00.0"]
    assert [parse_bdf(b) for b in found] == found


def test_text_paths_and_ids():
    assert addresses_in("pcieport 0000:a0:02.0: AER: ... 0000:a8:00.0 and PCI:0000:3b:00") == [
        "0000:a0:02.0", "0000:a8:00.0", "0000:3b:00.0"]
    assert normalise_bdf("+pci:0000:03:00.1") == "0000:03:00.1" and normalise_bdf("no address") is None
    assert bdf_in_path("/devices/pci0000:a0/0000:a0:02.0/0000:A1:00.0/drm/card1") == "0000:a1:00.0"
    assert bdf_in_path("/devices/virtual/drm/ttm") is None
    assert parse_pci_id(" 1002:744C ") == "1002:744c" and not is_canonical("05:00.0")
    with pytest.raises(ValueError, match="PCI id like 1002:744c"):
        parse_pci_id("1002-744c")
