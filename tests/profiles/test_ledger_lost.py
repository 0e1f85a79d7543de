"""A lost GPU's profile state is `lost`, not the verified result from before it fell off the
bus (issue 21): gpuguard_profile_verified reads 0, the apply counters do not move."""
from __future__ import annotations

from gpuguard.profiles.apply import CardResult
from gpuguard.profiles.ledger import ProfileLedger


def _samples(ledger: ProfileLedger) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in ledger.metrics() for s in m.samples}


def test_lost_card_is_not_verified_and_applies_are_not_counted():
    ledger = ProfileLedger()
    ledger.record(CardResult(gpu="xtx-1", bdf="0000:b0:00.0", profile="xtx-2000", result="ok", verified=True,
                             message="applied"))
    key = ("gpuguard_profile_verified", (("gpu", "xtx-1"), ("profile", "xtx-2000")))
    assert _samples(ledger)[key] == 1.0
    ledger.mark_lost("xtx-1")
    ledger.mark_lost("xtx-1")  # every poll while lost: one state, no counting
    m = _samples(ledger)
    assert m[key] == 0.0
    applies = {k: v for k, v in m.items() if k[0] == "gpuguard_profile_apply_total"}
    assert applies == {("gpuguard_profile_apply_total",
                        (("gpu", "xtx-1"), ("profile", "xtx-2000"), ("result", "ok"))): 1.0}
    state = ledger.view()["gpus"]["xtx-1"]
    assert (state["result"], state["verified"]) == ("lost", False) and "lost" in state["message"]
    ledger.mark_lost("r9700-a")  # a card without a profile: nothing to mark
    assert "r9700-a" not in ledger.view()["gpus"]
