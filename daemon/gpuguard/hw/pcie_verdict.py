"""The PCIe verdicts, as small pure functions over numbers: a link's usable bandwidth, what
both ends of a link can, whether it runs below that (downgraded), which hop is a GPU's
narrowest (a tie goes to the one nearest the root), which link is the card's slot, whether
a slower link is a finding now, and whether the CPU sees all of a card's VRAM through its
BAR (large BAR). The walk (gpuguard.hw.pcie) and the model (gpuguard.hw.pcie_model) ask
these; nothing here reads a file or knows a class.

Speeds are GT/s per lane, widths lanes, bandwidths bytes per second per direction, sizes
bytes; None is "could not be read" and never counts as zero.
"""
from __future__ import annotations

from typing import Sequence


def encoding_efficiency(gts: float) -> float:
    """Payload share of the line rate: 8b/10b up to 5 GT/s, 128b/130b from 8 GT/s,
    242B/256B FLIT at 64 GT/s."""
    if gts <= 5.0:
        return 8 / 10
    if gts < 64.0:
        return 128 / 130
    return 242 / 256


def link_bytes_per_second(gts: float | None, width: int | None) -> float | None:
    """Usable bandwidth of a link per direction, bytes/s; None when a figure is unknown."""
    if not gts or not width:
        return None
    return gts * 1e9 * encoding_efficiency(gts) * width / 8


def capability(upper: float | None, lower: float | None) -> float | None:
    """What a link can (speed or width): the lesser of both ends' maximum, or the one end
    known."""
    known = [v for v in (upper, lower) if v]
    return min(known) if known else None


def limited_by(upper_bdf: str, lower_bdf: str, max_speeds: tuple[float | None, float | None],
               max_widths: tuple[int | None, int | None]) -> str | None:
    """The end whose maximum sets what the link can: the slower one, else the narrower one;
    None when both ends can the same or one end is unknown."""
    for upper, lower in (max_speeds, max_widths):
        if upper and lower and upper != lower:
            return upper_bdf if upper < lower else lower_bdf
    return None


def downgraded(current: float | None, capable: float | None) -> bool:
    """A link running below what both ends can (speed or width, one at a time)."""
    return bool(current and capable and current < capable)


def narrowest(bandwidths: Sequence[float | None]) -> int | None:
    """Index of the slowest link of a path given root first (None: not a link that can be a
    bottleneck, or unknown). On a tie the one nearest the root: the upstream link limits
    everything below it, so it is the one to fix first."""
    at, best = None, None
    for i, bw in enumerate(bandwidths):
        if bw is None:
            continue
        if best is None or bw < best:
            at, best = i, bw
    return at


def slot_link(kinds: Sequence[str | None]) -> int | None:
    """Index of the card's slot link in a path given root first: the external link nearest
    the GPU (the links below it are inside the card)."""
    for i in range(len(kinds) - 1, -1, -1):
        if kinds[i] == "external":
            return i
    return None


def speed_drop_is_real(busy: bool, dpm_active_gts: float | None, current_gts: float | None) -> bool:
    """Whether a link running slower than both ends can is a finding now: links slow down
    at idle (ASPM, amdgpu's dynamic PCIe), so only while the GPU works — or when amdgpu's
    own active `pp_dpm_pcie` level asks for more than the link runs."""
    if busy:
        return True
    return bool(dpm_active_gts and current_gts and dpm_active_gts > current_gts)


def large_bar(vram: int | None, visible: int | None, kernel: tuple[int, int] | None,
              largest_bar: tuple[int, int] | None) -> bool | None:
    """True: the CPU sees all VRAM; None: nothing on this host tells. By preference the
    driver's visible-VRAM figure, then the kernel log's `Detected VRAM RAM=…M, BAR=…M`
    (`kernel` = (RAM, BAR) MiB), then the largest BAR ((index, bytes)) against the VRAM
    size: NVIDIA exports no visible figure, its CPU sees VRAM through that BAR."""
    if vram and visible is not None:
        return visible >= vram
    if kernel is not None:
        ram, bar = kernel
        return bar >= ram
    if vram and largest_bar is not None:
        return largest_bar[1] >= vram
    return None


def large_bar_note(vram: int | None, visible: int | None, kernel: tuple[int, int] | None,
                   largest_bar: tuple[int, int] | None) -> str:
    """The `large_bar` verdict in words, naming the figures it rests on."""
    if vram and visible is not None:
        if visible >= vram:
            return f"large BAR active: CPU sees all {size_text(vram)} of VRAM"
        return f"large BAR not active: CPU sees {size_text(visible)} of {size_text(vram)} VRAM"
    if kernel is not None:
        ram, bar = kernel
        word = "active" if bar >= ram else "not active"
        return f"large BAR {word}: kernel log Detected VRAM RAM={ram}M, BAR={bar}M"
    if vram and largest_bar is not None:
        index, size = largest_bar
        word = "active" if size >= vram else "not active"
        return f"large BAR {word}: BAR{index} {size_text(size)} for {size_text(vram)} VRAM"
    return "large BAR unknown: the driver exports no VRAM size (mem_info_vram_total)"


def size_text(n: int) -> str:
    """`24 GiB`, `23.9 GiB`, `256 MiB`."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB".replace(".0 ", " ")
    return f"{n / (1 << 20):.0f} MiB"
