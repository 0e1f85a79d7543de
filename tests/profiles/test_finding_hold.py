"""A clock finding is a condition, not an edge: load swinging between idle and busy (on the
card itself, or on the twin it is compared with) is not its cause going away. It is held
while no judgement was possible this poll, and it clears only when a judgement shows
agreement or its cause goes (profile reverted or reset, card lost). The real verdicts,
ledger and debounce the profile lifecycle uses, poll by poll, with the lifecycle's
debounce (raise after 2 polls, clear after 1)."""
from __future__ import annotations

from gpuguard.state.conditions import Conditions
from gpuguard.profiles.apply import CardResult
from gpuguard.profiles.effective import effective_findings
from gpuguard.profiles.ledger import ProfileLedger
from gpuguard.profiles.schema import Profile
from gpuguard.state.events import Event
from gpuguard.state.snapshot import GpuSnapshot


def snap(name, mhz, busy, up=True):
    return GpuSnapshot(name=name, bdf="0000:aa:00.0", vendor="1002", device_id="744c", driver="amdgpu", model="XTX",
                       card=None, up=up, time=0.0, busy_ratio=busy, clocks_hz={"sclk": mhz * 1e6})


class Polls:
    """One poll = what ProfileLifecycle.on_cycle does with the clock check."""

    def __init__(self, in_effect=None):
        self.ledger, self.cond, self.events = ProfileLedger(), Conditions(raise_after=2, clear_after=1), []
        self.in_effect = in_effect or {}

    def poll(self, *gpus):
        observed, findings, compared = effective_findings(gpus, self.in_effect)
        self.ledger.set_effective({g: (self.in_effect.get(g, ("",))[0], m) for g, m in observed.items()},
                                  findings, compared)
        self.events += [(e.gpu, e.kind) for e in self.cond.update({
            (x.gpu, x.kind): Event(f"clock_{x.kind}", "warning", "profiles", x.message, gpu=x.gpu)
            for x in self.ledger.finding_list()})]

    def kinds(self, gpu):
        return sorted(x.kind for x in self.ledger.finding_list() if x.gpu == gpu)


def test_card_mismatch_holds_while_the_twin_cycles_idle_busy():
    """INCIDENTS §3 under a real workload: xtx-a busy at 1233 MHz (a forgotten limit outside
    gpuguard), its twin idle and busy by turns. One raise, no clear, over 8 load cycles."""
    p = Polls()
    for i in range(48):
        twin_busy = (i // 3) % 2 == 0
        p.poll(snap("xtx-a", 1233, 1.0), snap("xtx-b", 1802 if twin_busy else 500, 1.0 if twin_busy else 0.0))
        assert p.kinds("xtx-a") == ["card_mismatch"] or i == 0 and not twin_busy, i
    assert p.events == [("xtx-a", "clock_card_mismatch")]
    # Both idle by turns too: still held (nothing compared while either idles).
    for i in range(24):
        busy = (i // 2) % 2 == 0
        p.poll(snap("xtx-a", 1233 if busy else 500, 1.0 if busy else 0.0), snap("xtx-b", 500, 0.0))
    assert p.events == [("xtx-a", "clock_card_mismatch")]
    # At different loads (0.5 against 1.0) the cards are not compared: held as well.
    p.poll(snap("xtx-a", 1233, 1.0), snap("xtx-b", 1500, 0.5))
    assert p.kinds("xtx-a") == ["card_mismatch"]
    # A comparison that shows agreement (the limit was lifted outside gpuguard) clears it.
    p.poll(snap("xtx-a", 1790, 1.0), snap("xtx-b", 1802, 1.0))
    assert p.kinds("xtx-a") == [] and p.events == [("xtx-a", "clock_card_mismatch"),
                                                   ("xtx-a", "clock_card_mismatch_cleared")]


def test_limit_findings_hold_while_the_card_idles_by_turns():
    """above_limit / below_limit are judged only under load: an idle poll keeps the verdict."""
    for mhz, kind in ((1802, "above_limit"), (1233, "below_limit")):
        p = Polls({"xtx-a": ("xtx-1500", Profile(sclk_max_mhz=1500))})
        for i in range(48):
            busy = (i // 3) % 2 == 0
            p.poll(snap("xtx-a", mhz if busy else 500, 1.0 if busy else 0.0))
            assert p.kinds("xtx-a") == [kind], (kind, i)
        assert p.events == [("xtx-a", f"clock_{kind}")], kind
        # Under load within the limit: judged and agreeing, so it clears.
        p.poll(snap("xtx-a", 1490, 1.0))
        assert p.events == [("xtx-a", f"clock_{kind}"), ("xtx-a", f"clock_{kind}_cleared")], kind


def test_a_held_finding_goes_with_its_cause():
    """Held through idle polls, yet no finding outlives a revert, a reset or a lost card."""
    p = Polls({"xtx-a": ("xtx-1500", Profile(sclk_max_mhz=1500))})
    for _ in range(2):
        p.poll(snap("xtx-a", 1233, 1.0), snap("xtx-b", 1802, 1.0))
    assert p.kinds("xtx-a") == ["below_limit", "card_mismatch"]
    p.poll(snap("xtx-a", 500, 0.0), snap("xtx-b", 500, 0.0))
    assert p.kinds("xtx-a") == ["below_limit", "card_mismatch"]
    # The profile is reverted (the confirm window's restore): both findings go at once.
    p.ledger.record(CardResult("xtx-a", "0000:aa:00.0", "stock", "ok", True, "reverted"))
    assert p.kinds("xtx-a") == []
    # The twin falls off the bus while xtx-a's mismatch against it is held: the finding
    # named a card that is gone, so it goes.
    p.in_effect = {}
    for _ in range(2):
        p.poll(snap("xtx-a", 1233, 1.0), snap("xtx-b", 1802, 1.0))
    p.poll(snap("xtx-a", 1233, 1.0), snap("xtx-b", 0, None, up=False))
    assert p.kinds("xtx-a") == ["card_mismatch"]
    p.ledger.mark_lost("xtx-b")
    assert p.kinds("xtx-a") == []
    # And a lost card's own findings go with it.
    for _ in range(2):
        p.poll(snap("xtx-a", 1233, 1.0), snap("xtx-b", 1802, 1.0))
    p.poll(snap("xtx-a", 0, None, up=False), snap("xtx-b", 1802, 1.0))
    p.ledger.mark_lost("xtx-a")
    assert p.kinds("xtx-a") == []
