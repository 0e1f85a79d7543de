"""Identity's exact answers: which card gets which name, which entries are missing with
which words, why each unnamed card is unnamed, how many cards the config describes —
including the known-binding rules that keep the order from being trusted when it
contradicts what this process already knew. bench/mutation.sh found these unobserved."""
from __future__ import annotations

from gpuguard.config.schema import GpuEntry
from gpuguard.state.identity import MissingCard, configured_counts, identify

A, B = "0000:aa:00.0", "0000:b0:00.0"  # two 7900 XTX
R1, R2 = "0000:05:00.0", "0000:08:00.0"  # two R9700
C = "0000:c0:00.0"


class Dev:
    def __init__(self, bdf: str, device_id: str) -> None:
        self.bdf, self.vendor, self.device_id = bdf, "1002", device_id


def xtx(*bdfs):
    return [Dev(b, "744c") for b in bdfs]


def r9700(*bdfs):
    return [Dev(b, "7551") for b in bdfs]


def by_index(name, pci_id, index, **kw):
    return GpuEntry(name=name, match={"pci_id": pci_id, "index": index, **kw})


XTX_ENTRIES = [by_index("xtx-0", "1002:744c", 0), by_index("xtx-1", "1002:744c", 1)]
R_ENTRIES = [by_index("r-0", "1002:7551", 0), by_index("r-1", "1002:7551", 1)]
ORDER_CHANGED = ("the order of the 2 cards with id 1002:744c changed since they were identified; which card this is "
                 "is unknown, so it is not named")
ONE_OF_TWO = ("1 of 2 cards with id 1002:744c present; which one is missing is unknown, so an index names no card "
              "(INCIDENTS §2)")


def test_configured_counts_take_the_largest_index_in_any_order():
    assert configured_counts([by_index("xtx-1", "1002:744c", 1), by_index("xtx-0", "1002:744c", 0)]) == {"1002:744c": 2}
    assert configured_counts([by_index("x", "1002:744c", 0, count=3), by_index("y", "1002:7551", 0),
                              GpuEntry(name="z", match={"bdf": A})]) == {"1002:744c": 3, "1002:7551": 1}


def test_configured_counts_cards_by_address_and_by_id():
    entries = [GpuEntry(name=n, match={"bdf": b}) for n, b in (("a", A), ("b", B), ("r", R1))] + [
        by_index("r-x", "1002:7551", 0)]
    ident = identify(xtx(A, B) + r9700(R1, R2), entries)
    assert ident.configured == 4
    assert dict(ident.names) == {A: "a", B: "b", R1: "r"}  # two 7551 present, one configured: none by index
    assert dict(ident.unnamed_why) == {R2: "2 of 1 cards with id 1002:7551 present; which one is missing is "
                                           "unknown, so an index names no card (INCIDENTS §2)"}


def test_a_missing_address_says_so():
    ident = identify(xtx(A), [GpuEntry(name="gone", match={"bdf": B})])
    assert ident.missing == (MissingCard("gone", B, "no card at this PCI address"),)
    assert dict(ident.names) == {} and dict(ident.unnamed_why) == {}


def test_every_group_is_named_when_each_is_complete():
    ident = identify(xtx(A, B) + r9700(R1, R2), XTX_ENTRIES + R_ENTRIES)
    assert dict(ident.names) == {A: "xtx-0", B: "xtx-1", R1: "r-0", R2: "r-1"}
    assert (ident.missing, dict(ident.unnamed_why), ident.configured) == ((), {}, 4)


def test_an_incomplete_group_names_none_and_says_why_for_each():
    ident = identify(xtx(B), XTX_ENTRIES)
    assert ident.missing == (MissingCard("xtx-0", "1002:744c #0", ONE_OF_TWO), MissingCard("xtx-1", "1002:744c #1", ONE_OF_TWO))
    assert (dict(ident.names), dict(ident.unnamed_why)) == ({}, {B: ONE_OF_TWO})


def test_a_known_card_keeps_its_name_and_the_rest_of_its_group_is_missing():
    ident = identify(xtx(A), XTX_ENTRIES, known={A: "xtx-0"})
    assert dict(ident.names) == {A: "xtx-0"}
    assert ident.missing == (MissingCard("xtx-1", "1002:744c #1", ONE_OF_TWO),)


def test_a_known_binding_that_is_not_present_names_nothing():
    ident = identify(xtx(B), XTX_ENTRIES, known={A: "xtx-0"})
    assert dict(ident.names) == {} and [m.name for m in ident.missing] == ["xtx-0", "xtx-1"]


def test_a_known_binding_to_a_name_of_another_group_is_not_taken():
    ident = identify(xtx(B), XTX_ENTRIES, known={B: "r-0"})
    assert dict(ident.names) == {} and dict(ident.unnamed_why) == {B: ONE_OF_TWO}


def test_the_order_is_not_trusted_when_a_card_was_known_by_another_name():
    ident = identify(xtx(A, B), XTX_ENTRIES, known={B: "r-0"})
    assert dict(ident.names) == {}
    assert ident.missing == (MissingCard("xtx-0", "1002:744c #0", ORDER_CHANGED), MissingCard("xtx-1", "1002:744c #1", ORDER_CHANGED))
    assert dict(ident.unnamed_why) == {A: ORDER_CHANGED, B: ORDER_CHANGED}


def test_the_order_is_not_trusted_when_a_name_is_known_at_another_present_address():
    ident = identify(xtx(A, B) + r9700(C), XTX_ENTRIES, known={C: "xtx-0"})
    assert A not in ident.names and B not in ident.names
    assert [m.why for m in ident.missing] == [ORDER_CHANGED, ORDER_CHANGED]



def test_an_unnamed_card_of_a_group_whose_entries_all_hold_is_not_identified():
    """Three XTX for two configured, both names held by what this process knew: the third
    card is unnamed for no missing entry of its own (not for another group's address)."""
    entries = [GpuEntry(name="gone", match={"bdf": R1})] + XTX_ENTRIES
    ident = identify(xtx(A, B, C), entries, known={A: "xtx-0", B: "xtx-1"})
    assert dict(ident.names) == {A: "xtx-0", B: "xtx-1"}
    assert ident.missing == (MissingCard("gone", R1, "no card at this PCI address"),)
    assert dict(ident.unnamed_why) == {C: "not identified"}
