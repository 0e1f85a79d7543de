"""The /dev/kmsg record format: header fields, escaping, dictionary lines, bad records."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from gpuguard.kernel.kmsg import KmsgFormatError, parse_record, unescape_kmsg


def kernel_escape(data: bytes) -> bytes:
    """What printk's devkmsg_read does to message bytes (msg_add_ext_text)."""
    return b"".join(b"\\x%02x" % c if c < 0x20 or c >= 0x7F or c == 0x5C else bytes((c,)) for c in data)


@given(st.binary(max_size=300))
def test_escaping_round_trips(data):
    rec = parse_record(b"6,1,2,-;" + kernel_escape(data) + b"\n SUBSYSTEM=pci\n")
    assert rec.text == data.decode("utf-8", "replace")
    assert "\n" not in rec.raw_text


def test_header_fields_dictionary_and_unknown_extras():
    rec = parse_record(b"11,41256,36156010,-,caller=T291,future=1;amdgpu 0000:d3:00.0: hi\\x0athere\n"
                       b" SUBSYSTEM=pci\n DEVICE=+pci:0000:D3:00.0\n")
    assert (rec.pri, rec.facility, rec.level, rec.seq, rec.usec, rec.flags, rec.caller) == \
        (11, 1, 3, 41256, 36156010, "-", "T291")
    assert rec.text == "amdgpu 0000:d3:00.0: hi\nthere"
    assert rec.raw_text == "amdgpu 0000:d3:00.0: hi\\x0athere"
    assert dict(rec.fields) == {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:D3:00.0"}
    assert rec.device_bdf == "0000:d3:00.0"
    assert not rec.from_kernel
    assert parse_record(b"6,1,2,-;no dictionary").device_bdf is None
    assert parse_record(b"6,1,2,-;x\n DEVICE=c4:5\n").device_bdf is None  # a char device, not PCI


def test_semicolon_inside_the_text_is_text():
    assert parse_record(b"4,9,9,-;a;b;c\n").text == "a;b;c"


def test_utf8_arrives_escaped_and_is_decoded():
    assert unescape_kmsg("temp 85\\xc2\\xb0C") == "temp 85°C"
    assert unescape_kmsg(b"bad \\xff byte") == "bad \ufffd byte"
    assert unescape_kmsg("not an escape \\xZZ") == "not an escape \\xZZ"


@pytest.mark.parametrize("raw,needle", [
    (b"no header at all", "without ';'"),
    (b"6,1;short header", "PRI,SEQ,USEC,FLAGS"),
    (b"x,1,2,-;text", "not numbers"),
    (b"-6,1,2,-;text", "negative"),
    (b"6,18446744073709551616,2,-;text", "beyond the kernel's u64"),
])
def test_malformed_records_raise_a_clear_error(raw, needle):
    with pytest.raises(KmsgFormatError, match=needle):
        parse_record(raw)
