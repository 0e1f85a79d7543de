"""The PCIe verdicts one by one, at their boundaries: bandwidth per encoding, what a link
can, which end limits it, downgrade, the narrowest hop and its tie-break, the slot link,
when a slower link is a finding, large BAR and its words."""
from __future__ import annotations

import pytest

from gpuguard.hw import pcie_verdict as v

GIB, MIB = 1 << 30, 1 << 20


def test_encoding_changes_at_8_and_at_64_gts():
    assert v.encoding_efficiency(2.5) == v.encoding_efficiency(5.0) == 8 / 10
    assert v.encoding_efficiency(8.0) == v.encoding_efficiency(32.0) == 128 / 130
    assert v.encoding_efficiency(63.9) == 128 / 130
    assert v.encoding_efficiency(64.0) == 242 / 256


def test_link_bandwidth_per_direction():
    assert v.link_bytes_per_second(5.0, 16) == 8.0e9  # Gen2 x16: the INCIDENTS §4 slot
    assert v.link_bytes_per_second(16.0, 16) == pytest.approx(31.5077e9, rel=1e-5)
    assert v.link_bytes_per_second(64.0, 1) == 64e9 * 242 / 256 / 8
    for gts, width in ((None, 16), (16.0, None), (0.0, 16), (16.0, 0)):
        assert v.link_bytes_per_second(gts, width) is None  # unknown, never zero


def test_capability_is_the_lesser_end_or_the_one_known():
    assert v.capability(16.0, 8.0) == v.capability(8.0, 16.0) == 8.0
    assert v.capability(None, 8.0) == v.capability(8.0, None) == 8.0
    assert v.capability(None, None) is None


def test_limited_by_names_the_slower_end_then_the_narrower():
    speeds_differ = ((8.0, 16.0), (16, 16))
    assert v.limited_by("up", "low", *speeds_differ) == "up"
    assert v.limited_by("up", "low", (16.0, 8.0), (16, 16)) == "low"
    # equal speeds: the width decides
    assert v.limited_by("up", "low", (16.0, 16.0), (16, 8)) == "low"
    assert v.limited_by("up", "low", (16.0, 16.0), (4, 8)) == "up"
    # the speed decides before the width
    assert v.limited_by("up", "low", (16.0, 8.0), (4, 16)) == "low"
    # one end unknown: no end is blamed for the speed
    assert v.limited_by("up", "low", (None, 8.0), (16, 16)) is None
    assert v.limited_by("up", "low", (None, 8.0), (16, 8)) == "low"
    assert v.limited_by("up", "low", (16.0, 16.0), (16, 16)) is None


def test_downgraded_only_strictly_below_a_known_capability():
    assert v.downgraded(5.0, 16.0) is True
    assert v.downgraded(16.0, 16.0) is False
    assert v.downgraded(16.0, 8.0) is False
    assert v.downgraded(None, 16.0) is False and v.downgraded(5.0, None) is False


def test_narrowest_is_the_slowest_link_and_a_tie_goes_to_the_one_nearest_the_root():
    assert v.narrowest([None, 15.7e9, 8e9, 31.5e9]) == 2
    assert v.narrowest([None, 8e9, 31.5e9, 8e9]) == 1  # tie: nearest the root
    assert v.narrowest([8e9, 8e9]) == 0
    assert v.narrowest([None, None]) is None and v.narrowest([]) is None
    assert v.narrowest([None, 31.5e9, 8e9 + 1, None, 8e9]) == 4


def test_the_slot_link_is_the_external_link_nearest_the_gpu():
    # root port, card upstream (slot), card downstream (internal bus), GPU (card-internal link)
    assert v.slot_link([None, "external", None, "card_internal"]) == 1
    # behind a switch: the switch's own links are external too; the slot is the last one
    assert v.slot_link([None, "external", None, "switch_internal", None, "external", None, "card_internal"]) == 5
    assert v.slot_link([None, "switch_internal"]) is None and v.slot_link([]) is None
    assert v.slot_link(["external"]) == 0  # a GPU on the root bus: its own link


def test_a_slower_link_is_a_finding_under_load_or_when_the_driver_asks_for_more():
    assert v.speed_drop_is_real(True, None, 5.0) is True
    assert v.speed_drop_is_real(False, None, 5.0) is False  # idle: power saving
    assert v.speed_drop_is_real(False, 16.0, 5.0) is True  # amdgpu's active level wants 16
    assert v.speed_drop_is_real(False, 5.0, 5.0) is False
    assert v.speed_drop_is_real(False, 16.0, None) is False


def test_large_bar_prefers_the_drivers_figure_then_the_kernel_line_then_the_largest_bar():
    assert v.large_bar(24 * GIB, 24 * GIB, None, None) is True
    assert v.large_bar(24 * GIB, 256 * MIB, (24560, 24560), (0, 32 * GIB)) is False  # driver's figure first
    assert v.large_bar(None, None, (24560, 256), (0, 32 * GIB)) is False  # then the kernel line
    assert v.large_bar(None, None, (32624, 32768), None) is True
    assert v.large_bar(None, None, (32768, 32768), None) is True  # equal is enough
    assert v.large_bar(24 * GIB, None, None, (0, 32 * GIB)) is True  # NVIDIA: the largest BAR
    assert v.large_bar(24 * GIB, None, None, (0, 24 * GIB - 1)) is False
    assert v.large_bar(24 * GIB, None, None, (0, 24 * GIB)) is True
    assert v.large_bar(24 * GIB, 24 * GIB - 1, None, None) is False
    assert v.large_bar(None, 256 * MIB, None, (0, 32 * GIB)) is None  # no VRAM size: no telling
    assert v.large_bar(24 * GIB, None, None, None) is None


def test_large_bar_note_names_its_figures():
    assert v.large_bar_note(24 * GIB, 24 * GIB, None, None) == "large BAR active: CPU sees all 24 GiB of VRAM"
    assert v.large_bar_note(24 * GIB, 256 * MIB, None, None) == "large BAR not active: CPU sees 256 MiB of 24 GiB VRAM"
    assert v.large_bar_note(None, None, (24560, 256), None) == \
        "large BAR not active: kernel log Detected VRAM RAM=24560M, BAR=256M"
    assert v.large_bar_note(None, None, (256, 256), None) == "large BAR active: kernel log Detected VRAM RAM=256M, BAR=256M"
    assert v.large_bar_note(24 * GIB, None, None, (2, 256 * MIB)) == "large BAR not active: BAR2 256 MiB for 24 GiB VRAM"
    assert v.large_bar_note(24 * GIB, None, None, (0, 32 * GIB)) == "large BAR active: BAR0 32 GiB for 24 GiB VRAM"
    assert v.large_bar_note(None, None, None, (0, 32 * GIB)) == \
        "large BAR unknown: the driver exports no VRAM size (mem_info_vram_total)"


def test_sizes_in_words():
    assert v.size_text(24 * GIB) == "24 GiB"
    assert v.size_text(GIB) == "1 GiB"
    assert v.size_text(GIB + GIB // 2) == "1.5 GiB"
    assert v.size_text(GIB - 1) == "1024 MiB"
    assert v.size_text(256 * MIB) == "256 MiB"


def test_the_slot_link_is_the_external_one_nearest_the_gpu_at_any_position():
    from gpuguard.hw.pcie_verdict import slot_link

    assert slot_link(["external", "external", "internal"]) == 1
    assert slot_link(["external", "internal", "internal"]) == 0
    assert slot_link(["internal", None]) is None


def test_a_bar_exactly_the_vram_size_is_a_large_bar():
    from gpuguard.hw.pcie_verdict import large_bar_note

    assert large_bar_note(16 << 30, None, None, (0, 16 << 30)) == "large BAR active: BAR0 16 GiB for 16 GiB VRAM"
    assert large_bar_note(16 << 30, None, None, (2, 256 << 20)) == "large BAR not active: BAR2 256 MiB for 16 GiB VRAM"
