"""The one PCI-address module (issue 14: five regexes had grown across the code)."""
from __future__ import annotations

import pytest

from gpuguard.hw.pci_address import addresses_in, bdf_in_path, is_canonical, normalise_bdf, parse_bdf, parse_pci_id


@pytest.mark.parametrize("text,want", [
    ("0000:05:00.0", "0000:05:00.0"), ("05:00.0", "0000:05:00.0"), (" 0000:AA:00.0 ", "0000:aa:00.0"),
    ("10000:e1:00.1", "10000:e1:00.1"),  # VMD domains print more than four digits
])
def test_parse_bdf(text, want):
    assert parse_bdf(text) == want and is_canonical(want)


@pytest.mark.parametrize("bad", ["0000:zz:00.0", "5:00.0", "0000:05:00.8", "card0", "", "1500.0"])
def test_parse_bdf_refuses_with_the_value_named(bad):
    with pytest.raises(ValueError, match="is not a PCI address like 0000:05:00.0"):
        parse_bdf(bad)


def test_text_paths_and_ids():
    assert addresses_in("pcieport 0000:a0:02.0: AER: ... 0000:a8:00.0 and PCI:0000:3b:00") == [
        "0000:a0:02.0", "0000:a8:00.0", "0000:3b:00.0"]
    assert normalise_bdf("+pci:0000:03:00.1") == "0000:03:00.1" and normalise_bdf("no address") is None
    assert bdf_in_path("/devices/pci0000:a0/0000:a0:02.0/0000:A1:00.0/drm/card1") == "0000:a1:00.0"
    assert bdf_in_path("/devices/virtual/drm/ttm") is None
    assert parse_pci_id(" 1002:744C ") == "1002:744c" and not is_canonical("05:00.0")
    with pytest.raises(ValueError, match="PCI id like 1002:744c"):
        parse_pci_id("1002-744c")
