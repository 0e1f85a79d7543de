"""Config-space parsing: real capability lists, truncated (non-root) reads, garbage."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.hw.pcie_config import build_config, find_capability, parse_config


def test_root_port_capability_fields():
    data = build_config(0x8086, 0x6F04, 0x060400, header_type=1, port_type=4, max_speed=3, max_width=16,
                        cur_speed=3, cur_width=16, devcap2=0x3C0, size=4096)
    cfg = parse_config(data)
    assert (cfg.vendor, cfg.device, cfg.header_type) == ("8086", "6f04", 1)
    assert cfg.port_type == "root_port" and cfg.has_pcie and not cfg.truncated
    assert (cfg.max_speed_gts, cfg.max_width, cfg.current_speed_gts, cfg.current_width) == (8.0, 16, 8.0, 16)
    assert cfg.atomics.describe() == "Routing+ 32bit+ 64bit+ 128bitCAS+"
    assert find_capability(data, 0x10) == 0x80
    assert find_capability(data, 0x05) is None  # MSI absent: the walk ends at next=0


def test_bits_are_read_one_by_one():
    for bit, name in ((7, "completer32"), (8, "completer64"), (9, "completer128_cas"), (6, "routing")):
        a = parse_config(build_config(1, 2, 0x060400, port_type=4, devcap2=1 << bit)).atomics
        assert [k for k in ("routing", "completer32", "completer64", "completer128_cas") if getattr(a, k)] == [name]


def test_unprivileged_64_bytes_are_truncated_not_guessed():
    cfg = parse_config(build_config(0x8086, 0x6F04, 0x060400, port_type=4, devcap2=0x3C0, size=64))
    assert cfg.truncated and cfg.vendor == "8086"
    assert cfg.port_type is None and cfg.atomics is None and cfg.has_pcie is None


def test_no_capability_list():
    cfg = parse_config(build_config(0x1AF4, 0x1042, 0x018000))
    assert cfg.has_pcie is False and cfg.atomics is None


def test_loop_and_pointer_into_header_are_problems():
    buf = bytearray(build_config(1, 2, 0x060400, port_type=4))
    buf[0x41] = 0x40  # PM capability points at itself
    assert "loops" in parse_config(bytes(buf)).problem
    buf[0x34] = 0x20
    assert "into the header" in parse_config(bytes(buf)).problem


def test_capability_version_1_has_no_devcap2():
    buf = bytearray(build_config(1, 2, 0x060400, port_type=4, devcap2=0x3C0))
    buf[0x82] = (4 << 4) | 1
    cfg = parse_config(bytes(buf))
    assert cfg.port_type == "root_port" and cfg.atomics is None


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=512))
def test_any_bytes_parse_without_raising(data):
    cfg = parse_config(data)
    assert cfg.size == len(data)
