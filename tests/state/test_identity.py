"""Identity fails closed (issue 11 item 1, INCIDENTS §2): `{pci_id, index}` names a card
only while every card of that id is present. With any one card missing, no card of that
id is named, so no profile can land on the wrong card; the missing entries are named."""
from __future__ import annotations

import pytest

from gpuguard.config.schema import GpuEntry
from gpuguard.state.identity import assign_names, identify, missing_names

R9700 = ("0000:05:00.0", "0000:08:00.0")
XTX = ("0000:aa:00.0", "0000:b0:00.0")


class Dev:
    def __init__(self, bdf: str, device_id: str) -> None:
        self.bdf, self.vendor, self.device_id = bdf, "1002", device_id


def host(without: str | None = None) -> list[Dev]:
    return [Dev(b, "7551") for b in R9700 if b != without] + [Dev(b, "744c") for b in XTX if b != without]


ENTRIES = [
    GpuEntry(name="r9700-a", match={"bdf": R9700[0]}, profile=None),
    GpuEntry(name="r9700-b", match={"bdf": R9700[1]}),
    GpuEntry(name="xtx-0", match={"pci_id": "1002:744c", "index": 0}),
    GpuEntry(name="xtx-1", match={"pci_id": "1002:744c", "index": 1}),
]


def test_all_present_every_card_named_in_address_order():
    ident = identify(host(), ENTRIES)
    assert dict(ident.names) == {R9700[0]: "r9700-a", R9700[1]: "r9700-b", XTX[0]: "xtx-0", XTX[1]: "xtx-1"}
    assert ident.missing == () and ident.configured == 4


@pytest.mark.parametrize("gone", XTX)
def test_either_xtx_missing_names_neither_and_reports_both(gone):
    # the bug: with xtx-0 missing, "index 0" was the second card and got xtx-0's profile
    ident = identify(host(without=gone), ENTRIES)
    other = next(b for b in XTX if b != gone)
    assert other not in ident.names
    assert ident.name(other) == other
    assert {m.name for m in ident.missing} == {"xtx-0", "xtx-1"}
    assert {m.match for m in ident.missing} == {"1002:744c #0", "1002:744c #1"}
    assert "1 of 2 cards with id 1002:744c present" in ident.missing[0].why
    # the cards matched by address are unaffected
    assert ident.names[R9700[0]] == "r9700-a" and ident.names[R9700[1]] == "r9700-b"
    assert missing_names(host(without=gone), ENTRIES) == ["xtx-0", "xtx-1"]


@pytest.mark.parametrize("gone", R9700)
def test_a_card_matched_by_address_missing_is_named_alone(gone):
    ident = identify(host(without=gone), ENTRIES)
    name = "r9700-a" if gone == R9700[0] else "r9700-b"
    assert [(m.name, m.match) for m in ident.missing] == [(name, gone)]
    assert ident.names[XTX[0]] == "xtx-0" and ident.names[XTX[1]] == "xtx-1"


def test_count_says_how_many_cards_the_host_has():
    # only xtx-0 configured, but the host has two: with `count: 2` one missing XTX is seen
    entries = [GpuEntry(name="xtx-0", match={"pci_id": "1002:744c", "index": 0, "count": 2})]
    assert identify(host(), entries).names == {XTX[0]: "xtx-0"}
    ident = identify(host(without=XTX[0]), entries)
    assert ident.names == {} and [m.name for m in ident.missing] == ["xtx-0"]
    # without count, the config implies one card: a second one makes the group incomplete
    plain = [GpuEntry(name="xtx-0", match={"pci_id": "1002:744c", "index": 0})]
    assert identify(host(), plain).names == {}
    assert identify(host(without=XTX[1]), plain).names == {XTX[0]: "xtx-0"}


def test_a_card_identified_earlier_keeps_its_name_while_its_peer_is_lost():
    known = {XTX[1]: "xtx-1"}
    ident = identify(host(without=XTX[0]), ENTRIES, known)
    assert ident.names[XTX[1]] == "xtx-1"
    assert [(m.name, m.match) for m in ident.missing] == [("xtx-0", "1002:744c #0")]


def test_a_card_back_at_another_address_is_named_only_when_the_order_agrees():
    known = {XTX[1]: "xtx-1"}
    moved_before = host(without=XTX[0]) + [Dev("0000:a0:00.0", "744c")]
    assert identify(moved_before, ENTRIES, known).names["0000:a0:00.0"] == "xtx-0"
    moved_after = host(without=XTX[0]) + [Dev("0000:c0:00.0", "744c")]
    ident = identify(moved_after, ENTRIES, known)
    # by order the new card would be xtx-1 and b0 xtx-0, contradicting what is known: fail closed
    assert "0000:c0:00.0" not in ident.names and ident.names[XTX[1]] == "xtx-1"
    assert [m.name for m in ident.missing] == ["xtx-0"] and "order" in ident.missing[0].why


def test_assign_names_gives_every_device_a_name():
    names = assign_names(host(without=XTX[0]), ENTRIES)
    assert names[XTX[1]] == XTX[1] and names[R9700[0]] == "r9700-a"


def test_count_must_exceed_index():
    with pytest.raises(ValueError):
        GpuEntry(name="x", match={"pci_id": "1002:744c", "index": 2, "count": 2})
