"""The GPU state owner's exact answers: every event it publishes (kind, severity, card,
words, fields), every listener call, every state after discovery, loss by each route,
return at the same or another address, not answering, reset, profile results, kernel
conditions and the summary line. bench/mutation.sh found these unobserved."""
from __future__ import annotations

import pytest

from gpuguard.config.schema import GpuEntry
from gpuguard.state.events import Event
from gpuguard.state.gpus import GpuState, GpuStates

R1, R2 = "0000:05:00.0", "0000:08:00.0"
X0, X1 = "0000:aa:00.0", "0000:b0:00.0"
MOVED = "0000:a0:00.0"
ENTRIES = [
    GpuEntry(name="r9700-a", match={"bdf": R1}, profile="p"),
    GpuEntry(name="r9700-b", match={"bdf": R2}),
    GpuEntry(name="xtx-0", match={"pci_id": "1002:744c", "index": 0}, profile="x"),
    GpuEntry(name="xtx-1", match={"pci_id": "1002:744c", "index": 1}, profile="x"),
]
SUFFIX = ("; nothing is written to it until it is back; recovery is kill the engines, then reboot (cold power-cycle "
          "if the reboot does not come back)")
ONE_OF_TWO = ("1 of 2 cards with id 1002:744c present; which one is missing is unknown, so an index names no card "
              "(INCIDENTS §2)")


class Dev:
    def __init__(self, bdf: str, device_id: str, model: str) -> None:
        self.bdf, self.vendor, self.device_id, self.model = bdf, "1002", device_id, model


def devs(*without: str, extra: tuple = ()) -> list[Dev]:
    return [Dev(b, "7551", "R9700") for b in (R1, R2) if b not in without] + \
        [Dev(b, "744c", "XTX") for b in (X0, X1) + extra if b not in without]


class Rig:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.now = 100.0
        self.g = GpuStates(self.events.append, ENTRIES, lost_after_seconds=10, clock=lambda: self.now)
        self.g.engines = {"qwen": ("xtx-0",), "llama": ("xtx-0", "r9700-a")}
        self.calls: list[tuple] = []
        for name in ("on_lost", "on_back", "on_new", "on_reset"):
            getattr(self.g, name).append(lambda s, how, name=name: self.calls.append((name, s.name, how)))

    def said(self) -> list[tuple]:
        out = [(e.kind, e.severity, e.source, e.gpu, e.bdf, e.message, dict(e.fields)) for e in self.events]
        self.events.clear()
        return out

    def heard(self) -> list[tuple]:
        out, self.calls = self.calls, []
        return out


@pytest.fixture
def rig() -> Rig:
    return Rig()


def started(rig: Rig) -> GpuStates:
    rig.g.observe(devs())
    rig.said(), rig.heard()
    return rig.g


# ------------------------------------------------------------------ discovery


def test_a_first_look_with_a_card_missing_then_the_late_card(rig):
    g = rig.g
    assert g.summary() == "starting: no poll yet"
    g.observe(devs(X1))
    assert rig.said() == [("gpus_missing", "alert", "gpus", None, None,
                           f"configured GPU(s) missing: xtx-0 (1002:744c #0): {ONE_OF_TWO}; xtx-1 (1002:744c #1): "
                           f"{ONE_OF_TWO}; nothing is applied to cards that are not identified",
                           {"missing": ["xtx-0", "xtx-1"], "condition": True})]
    assert rig.heard() == [("on_new", "r9700-a", "start"), ("on_new", "r9700-b", "start"),
                           ("on_new", X0, "start")]
    assert g.summary() == "3/4 GPUs up; missing xtx-0 (1002:744c #0), xtx-1 (1002:744c #1)"
    assert list(g.conditions) == [("host", "gpus_missing")]
    assert g.metrics_rows() == [("xtx-0", "1002:744c #0"), ("xtx-1", "1002:744c #1")]
    a, b, x = g.all()
    assert (a.name, a.named, a.model, a.profile, a.profile_state, a.generation, a.pending_why) == (
        "r9700-a", True, "R9700", "p", "pending", 1, "daemon start")
    assert (b.name, b.profile, b.profile_state, b.generation) == ("r9700-b", None, "none", 1)
    assert (x.name, x.named, x.profile, x.profile_state, x.generation, x.why_unnamed, x.pending_why) == (
        X0, False, None, "none", 0, ONE_OF_TWO, "")
    assert g.names() == {R1: "r9700-a", R2: "r9700-b", X0: X0}

    g.observe(devs())
    assert rig.said() == [("gpu_appeared", "info", "gpus", "xtx-1", X1, f"GPU xtx-1 ({X1}) appeared", {}),
                          ("gpus_complete", "info", "gpus", None, None, "every configured GPU is present and "
                                                                        "identified", {})]
    assert rig.heard() == [("on_new", "xtx-1", "appeared")]
    assert g.conditions == {} and g.metrics_rows() == [] and g.summary() == "4/4 GPUs up"
    x0, x1 = g.get(X0), g.get(X1)
    assert (x0.name, x0.profile_state, x0.generation, x0.why_unnamed, x0.pending_why) == (
        "xtx-0", "pending", 1, None, "GPU appeared (late card or back from lost)")
    assert x1.to_dict() == {"bdf": X1, "name": "xtx-1", "named": True, "pci_id": "1002:744c", "model": "XTX",
                            "presence": "present", "on_bus": True, "lost_by": None, "profile": "x",
                            "profile_state": "pending", "generation": 1, "why_unnamed": None}
    g.observe(devs())  # nothing changed: nothing said
    assert rig.said() == [] and rig.heard() == []


def test_reading_the_state(rig):
    g = started(rig)
    assert [s.bdf for s in g] == [R1, R2, X0, X1] and [s.bdf for s in g.present()] == [R1, R2, X0, X1]
    assert (X0 in g, "0000:99:00.0" in g, g.get("0000:99:00.0")) == (True, False, None)
    assert (g.name(X0), g.name(None), g.name("0000:99:00.0")) == ("xtx-0", None, None)
    assert (g.bdf_of("xtx-1"), g.bdf_of(X1), g.bdf_of("nope")) == (X1, X1, None)
    assert (g.engines_on(X0), g.engines_on("xtx-0"), g.engines_on("r9700-a"), g.engines_on(X1)) == (
        ["llama", "qwen"], ["llama", "qwen"], ["llama"], [])
    assert (g.on_bus(X0), g.on_bus("0000:99:00.0"), g.is_lost(X0), g.is_lost("0000:99:00.0")) == (
        True, False, False, False)
    assert g.missing() == () and all(s.up for s in g)
    assert [s.bdf for s in g.pending()] == [R1, X0, X1]  # the ones with a profile
    g.begin_stop()
    assert g.pending() == [] and not any(g.may_write(b) for b in (R1, R2, X0, X1))


def test_may_write(rig):
    g = started(rig)
    assert all(g.may_write(b) for b in (R1, R2, X0, X1)) and not g.may_write("0000:99:00.0")
    g.not_answering(R2, "timeout")
    g.observe(devs(X1))
    assert (g.may_write(R2), g.may_write(X1), g.may_write(R1)) == (False, False, True)


# ------------------------------------------------------------------ lost and back


def test_gone_from_the_bus_and_back_at_the_same_address(rig):
    g = started(rig)
    gen = g.get(X0).generation
    g.observe(devs(X0))
    assert rig.said() == [
        ("gpu_lost", "critical", "gpus", "xtx-0", X0, f"GPU xtx-0 ({X0}) is gone from the PCI bus{SUFFIX}",
         {"route": "bus", "engines": ["llama", "qwen"], "condition": True}),
        ("gpus_missing", "alert", "gpus", None, None, f"configured GPU(s) missing: xtx-0 (1002:744c #0): {ONE_OF_TWO}; "
         "nothing is applied to cards that are not identified", {"missing": ["xtx-0"], "condition": True})]
    assert rig.heard() == [("on_lost", "xtx-0", "bus")]
    s = g.get(X0)
    assert (s.presence, s.on_bus, s.lost_by, s.profile_state, s.generation, s.not_answering_since) == (
        "lost", False, "bus", "lost", gen, None)
    assert g.is_lost(X0) and [p.bdf for p in g.present()] == [R1, R2, X1]
    assert g.summary() == "3/4 GPUs up; missing xtx-0 (1002:744c #0)"  # gone and missing: not also 'down'
    assert set(g.conditions) == {(X0, "gpu_lost"), ("host", "gpus_missing")}

    g.observe(devs())
    assert rig.said() == [
        ("gpu_back", "info", "gpus", "xtx-0", X0, f"GPU xtx-0 ({X0}) is back (bus); its profile is re-applied",
         {"how": "bus"}),
        ("gpus_complete", "info", "gpus", None, None, "every configured GPU is present and identified", {})]
    assert rig.heard() == [("on_back", "xtx-0", "bus")]
    s = g.get(X0)
    assert (s.presence, s.on_bus, s.lost_by, s.profile_state, s.generation, s.pending_why) == (
        "present", True, None, "pending", gen + 1, "GPU back (bus): stock settings")
    assert g.conditions == {}


def test_back_without_a_profile_says_nothing_about_one(rig):
    g = started(rig)
    g.observe(devs(R2))
    rig.said()
    g.observe(devs())
    assert rig.said()[0][5] == f"GPU r9700-b ({R2}) is back (bus)"
    assert (g.get(R2).profile_state, g.get(R2).presence) == ("none", "present")


def test_back_at_another_address(rig):
    g = started(rig)
    old_gen = g.get(X0).generation
    g.observe(devs(X0))
    rig.said(), rig.heard()
    g.observe(devs(X0, extra=(MOVED,)))
    assert rig.said() == [
        ("gpu_back", "info", "gpus", "xtx-0", MOVED, f"GPU xtx-0 is back at another address: {MOVED} (was {X0}); its "
         "profile is re-applied", {"how": "bus", "previous_bdf": X0, "was_lost": True}),
        ("gpus_complete", "info", "gpus", None, None, "every configured GPU is present and identified", {})]
    assert rig.heard() == [("on_back", "xtx-0", f"bus (at {MOVED}, was {X0})")]
    s = g.get(MOVED)
    assert (s.name, s.presence, s.profile_state, s.generation, s.pending_why) == (
        "xtx-0", "present", "pending", old_gen + 1, f"GPU back at another address (at {MOVED}, was {X0}): stock settings")
    assert X0 not in g and g.conditions == {}


def test_lost_by_the_kernel(rig):
    g = started(rig)
    assert g.mark_lost(X1, "kernel:device_lost", xid=79) is True
    assert rig.said() == [("gpu_lost", "critical", "gpus", "xtx-1", X1, f"GPU xtx-1 ({X1}) is lost "
                           f"(kernel:device_lost){SUFFIX}", {"route": "kernel:device_lost", "engines": [],
                                                             "condition": True, "xid": 79})]
    assert rig.heard() == [("on_lost", "xtx-1", "kernel:device_lost")]
    assert g.mark_lost(X1, "udev") is False and rig.said() == [] and rig.heard() == []
    assert g.get(X1).lost_by == "kernel:device_lost"
    assert g.mark_lost("0000:99:00.0", "udev") is False
    assert g.summary() == "3/4 GPUs up; down: xtx-1"
    g.answering(X1)  # a good read does not undo the kernel's word
    assert g.is_lost(X1)


def test_a_quiet_loss_runs_the_policy_without_its_own_alert(rig):
    g = started(rig)
    assert g.mark_lost(R2, "udev", "removed", quiet=True)
    assert rig.said() == [] and rig.heard() == [("on_lost", "r9700-b", "udev")]
    assert (R2, "gpu_lost") not in g.conditions
    assert (g.get(R2).profile_state, g.get(R2).presence) == ("none", "lost")  # no profile: stays none


def test_not_answering_then_answering_again(rig):
    g = started(rig)
    g.not_answering(R2, "read timed out")
    assert rig.said() == [("gpu_not_answering", "alert", "gpus", "r9700-b", R2,
                           f"GPU r9700-b ({R2}) stopped answering: read timed out", {})]
    s = g.get(R2)
    assert (s.presence, s.not_answering_since, s.up) == ("not_answering", 100.0, False)
    assert g.summary() == "3/4 GPUs up; down: r9700-b"
    rig.now = 105.0
    g.not_answering(R2, "read timed out")  # still within the limit: said once
    assert rig.said() == [] and g.get(R2).presence == "not_answering"
    g.answering(R2)
    assert rig.said() == [("gpu_answering", "info", "gpus", "r9700-b", R2, f"GPU r9700-b ({R2}) answers again", {})]
    assert (g.get(R2).presence, g.get(R2).not_answering_since) == ("present", None)
    g.answering(R2)  # answering while present: nothing
    assert rig.said() == []


def test_not_answering_for_the_limit_is_lost_and_answering_brings_it_back(rig):
    g = started(rig)
    gen = g.get(R1).generation
    g.not_answering(R1, "EIO")
    rig.now = 110.0
    g.not_answering(R1, "EIO")
    events = rig.said()
    assert [e[0] for e in events] == ["gpu_not_answering", "gpu_lost"]
    assert events[1][5] == (f"GPU r9700-a ({R1}) has not answered for 10 s (poll.lost_after_seconds 10): EIO{SUFFIX}")
    assert events[1][6] == {"route": "not_answering", "engines": ["llama"], "condition": True}
    assert rig.heard() == [("on_lost", "r9700-a", "not_answering")]
    s = g.get(R1)
    assert (s.presence, s.lost_by, s.profile_state, s.not_answering_since) == ("lost", "not_answering", "lost", None)
    g.not_answering(R1, "EIO")  # lost: no more
    assert rig.said() == []
    g.answering(R1)  # the window of good reads starts: lost_after_seconds of them is back
    assert rig.said() == [] and g.get(R1).answering_since == 110.0 and g.is_lost(R1)
    rig.now = 120.0
    g.answering(R1)
    assert rig.said()[0][:6] == ("gpu_back", "info", "gpus", "r9700-a", R1,
                                 f"GPU r9700-a ({R1}) is back (answering again for 10 s); its profile is re-applied")
    assert rig.heard() == [("on_back", "r9700-a", "answering again for 10 s")]
    assert g.get(R1).answering_since is None
    assert (g.get(R1).presence, g.get(R1).generation, g.get(R1).profile_state) == ("present", gen + 1, "pending")


def test_the_kernel_confirming_a_not_answering_loss_keeps_it_lost(rig):
    g = started(rig)
    g.not_answering(R1, "EIO")
    rig.now = 200.0
    g.not_answering(R1, "EIO")
    assert g.mark_lost(R1, "kernel:device_lost") is False
    assert g.get(R1).lost_by == "kernel:device_lost"
    g.answering(R1)
    assert g.is_lost(R1)


def test_not_answering_of_a_card_gone_from_the_bus_or_unknown_changes_nothing(rig):
    g = started(rig)
    g.observe(devs(R2))
    rig.said()
    g.not_answering(R2, "x")
    g.not_answering("0000:99:00.0", "x")
    g.answering(R2)
    g.answering("0000:99:00.0")
    assert rig.said() == [] and g.get(R2).presence == "lost"


def test_a_limit_of_zero_loses_the_card_at_once(rig):
    g = started(rig)
    g.lost_after_seconds = 0
    g.not_answering(R2, "x")
    assert [e[0] for e in rig.said()] == ["gpu_not_answering", "gpu_lost"]


# ------------------------------------------------------------------ reset, profiles


def test_reset_while_present_is_stock_settings(rig):
    g = started(rig)
    gen = g.get(X0).generation
    assert g.profile_result(X0, gen, True) and g.get(X0).profile_state == "verified"
    g.reset(X0, "kernel: GPU reset succeeded")
    s = g.get(X0)
    assert (s.generation, s.profile_state, s.pending_why) == (
        gen + 1, "pending", "kernel: GPU reset succeeded: the card is back at stock settings")
    assert rig.heard() == [("on_reset", "xtx-0", "kernel: GPU reset succeeded")] and rig.said() == []
    g.reset(R2, "kernel: GPU reset succeeded")  # no profile: its state stays
    assert g.get(R2).profile_state == "none"
    g.reset("0000:99:00.0", "x")
    assert rig.heard() == [("on_reset", "r9700-b", "kernel: GPU reset succeeded")]


def test_reset_of_a_lost_card_brings_it_back(rig):
    g = started(rig)
    g.mark_lost(X0, "kernel:gpu_reset_failed")
    rig.said(), rig.heard()
    g.reset(X0, "reset ok")
    assert rig.heard() == [("on_back", "xtx-0", "reset ok")]
    assert rig.said()[0][0] == "gpu_back" and g.get(X0).presence == "present"


def test_back_only_for_a_lost_card_on_the_bus(rig):
    g = started(rig)
    assert g.back(X0, "x") is False and g.back("0000:99:00.0", "x") is False
    g.observe(devs(X0))
    rig.said()
    assert g.back(X0, "udev add") is False  # still gone from discovery
    assert rig.said() == [] and g.is_lost(X0)


def test_pending_and_results(rig):
    g = started(rig)
    assert g.set_pending(R2) is None and g.set_pending("0000:99:00.0") is None
    gen = g.get(R1).generation
    assert g.set_pending(R1, "drift") == gen
    assert (g.get(R1).profile_state, g.get(R1).pending_why) == ("pending", "drift")
    assert g.profile_result(R1, gen, False) is True and g.get(R1).profile_state == "unverified"
    assert g.profile_result(R1, gen + 1, True) is False and g.get(R1).profile_state == "unverified"
    assert g.profile_result(R2, g.get(R2).generation, True) is False  # no profile
    assert g.profile_result("0000:99:00.0", 0, True) is False
    g.mark_lost(R1, "udev")
    assert g.set_pending(R1, "x") == gen and g.get(R1).profile_state == "lost"
    assert g.profile_result(R1, gen, True) is False


def test_configure_renames_and_reassigns(rig):
    g = started(rig)
    g.observe(devs())  # not the first look any more
    gen = g.get(R2).generation
    entries = [GpuEntry(name="r9700-a", match={"bdf": R1}, profile="p"),
               GpuEntry(name="r9700-b", match={"bdf": R2}, profile="q"),
               GpuEntry(name="xtx-0", match={"pci_id": "1002:744c", "index": 0}, profile="x"),
               GpuEntry(name="xtx-1", match={"pci_id": "1002:744c", "index": 1}, profile="x")]
    g.configure(entries)
    s = g.get(R2)
    assert (s.profile, s.profile_state, s.generation, s.pending_why) == ("q", "pending", gen + 1,
                                                                        "identity or assignment changed")
    assert g.engines == {"qwen": ("xtx-0",), "llama": ("xtx-0", "r9700-a")}  # engines not given: kept
    g.configure(entries, {"solo": ["r9700-b"]})
    assert g.engines == {"solo": ("r9700-b",)} and g.engines_on(R2) == ["solo"]
    # a card that lost its entry becomes unnamed: no profile, never written
    g.configure(entries[:1] + entries[2:])
    s = g.get(R2)
    assert (s.name, s.named, s.profile, s.profile_state) == (R2, False, None, "none")
    assert not g.may_write(R2)


def test_configure_of_a_lost_card_keeps_it_lost(rig):
    g = started(rig)
    g.mark_lost(R2, "kernel:device_lost")
    g.configure([GpuEntry(name="r9700-b", match={"bdf": R2}, profile="q")] + ENTRIES[2:] + ENTRIES[:1])
    assert g.get(R2).profile_state == "lost"


# ------------------------------------------------------------------ kernel


def test_kernel_events_are_counted_by_card_name_or_host_and_raise_and_clear_conditions(rig):
    g = started(rig)
    g.kernel_event(Event("oom_kill", "alert", "kmsg", "oom"))
    g.kernel_event(Event("vm_fault", "warning", "kmsg", "fault", bdf=X0))
    g.kernel_event(Event("vm_fault", "warning", "kmsg", "fault", gpu="given", bdf=X0))
    g.kernel_event(Event("vm_fault", "warning", "kmsg", "fault", bdf="0000:99:00.0"))
    hang = Event("gpu_hang", "alert", "kmsg", "hang", bdf=X0, fields={"condition": True})
    g.kernel_event(hang)
    assert dict(g.kernel_counts) == {("host", "oom_kill"): 1, ("xtx-0", "vm_fault"): 1, ("given", "vm_fault"): 1,
                                     ("host", "vm_fault"): 1, ("xtx-0", "gpu_hang"): 1}
    assert g.conditions == {(X0, "gpu_hang"): hang}
    g.kernel_event(Event("gpu_reset_ok", "info", "kmsg", "ok", bdf=X0), clears=("gpu_hang", "other"))
    assert g.conditions == {}
    psu = Event("psu_headroom", "alert", "power", "x", fields={"condition": True})
    g.kernel_event(psu)
    assert g.conditions == {("host", "psu_headroom"): psu}
    g.clear_conditions("host", ["psu_headroom", "never_raised"])
    assert g.conditions == {}


def test_a_broken_listener_does_not_stop_the_others(rig):
    g = rig.g
    g.on_new.insert(0, lambda s, how: 1 / 0)
    g.observe(devs())
    assert [c for c in rig.heard() if c[0] == "on_new"] == [
        ("on_new", "r9700-a", "start"), ("on_new", "r9700-b", "start"), ("on_new", "xtx-0", "start"),
        ("on_new", "xtx-1", "start")]


def test_summary_counts_cards_beyond_the_configured(rig):
    g = rig.g
    g.observe(devs(extra=("0000:c0:00.0",)))  # a third XTX: the group is incomplete, nothing named by index
    assert g.summary() == "5/5 GPUs up; missing xtx-0 (1002:744c #0), xtx-1 (1002:744c #1)"


def test_a_state_is_up_only_while_present():
    s = GpuState("0000:01:00.0", "1002:744c")
    assert s.up and not GpuState("0000:01:00.0", "1002:744c", presence="not_answering").up
    assert not GpuState("0000:01:00.0", "1002:744c", presence="lost").up


# ------------------------------------------------------------------ more exact answers


def test_a_complete_first_look_says_nothing(rig):
    rig.g.observe(devs())
    assert rig.said() == [] and rig.g.conditions == {}


def test_conditions_hold_the_events_that_raised_them(rig):
    g = started(rig)
    g.observe(devs(X0))
    lost, missing = [e for e in rig.events]
    assert g.conditions == {(X0, "gpu_lost"): lost, ("host", "gpus_missing"): missing}
    g.clear_conditions("host", ["gpus_missing"])  # cleared by hand: its end must not trip over that
    g.observe(devs())
    assert g.conditions == {}


def test_back_answers_whether_it_brought_the_card_back(rig):
    g = started(rig)
    g.mark_lost(X0, "kernel:device_lost")
    assert g.back(X0, "udev add") is True and g.back(X0, "udev add") is False


def test_present_leaves_out_a_card_the_kernel_lost(rig):
    g = started(rig)
    g.mark_lost(X0, "kernel:device_lost")
    assert g.on_bus(X0) and [s.bdf for s in g.present()] == [R1, R2, X1]


def test_summary_names_every_card_down_including_an_unnamed_one_gone(rig):
    g = rig.g
    g.observe(devs(extra=("0000:c0:00.0",)))  # three XTX for two configured: none named
    g.observe(devs())  # the third is gone: the pair is named, the third lost and named by nothing
    g.not_answering(R2, "timeout")
    assert g.summary() == "3/5 GPUs up; down: r9700-b, 0000:c0:00.0"


def test_a_card_without_a_model_is_question_mark_and_learns_it_when_back(rig):
    class Bare:
        def __init__(self, bdf):
            self.bdf, self.vendor, self.device_id = bdf, "1002", "7551"

    g = rig.g
    g.observe([Bare(R1)])
    assert g.get(R1).model == "?"
    g.observe([])
    g.observe([Bare(R1)])
    assert g.get(R1).model == "?"  # still nothing better known: kept
    g.observe([])
    g.observe([Dev(R1, "7551", "Radeon AI PRO R9700")])
    assert g.get(R1).model == "Radeon AI PRO R9700"


def test_a_card_back_elsewhere_and_a_new_card_in_the_same_look(rig):
    g = started(rig)
    g.configure(ENTRIES + [GpuEntry(name="spare", match={"bdf": "0000:c0:00.0"})])
    g.observe(devs(X0))
    rig.said(), rig.heard()
    g.observe(devs(X0, extra=(MOVED,)) + [Dev("0000:c0:00.0", "7551", "R9700")])
    assert rig.heard() == [("on_back", "xtx-0", f"bus (at {MOVED}, was {X0})"), ("on_new", "spare", "appeared")]


def test_an_unnamed_card_never_carries_a_profile_and_no_entry_takes_its_name(rig):
    g = rig.g
    # an unnamed card is called by its address: a configured name that is one is refused
    with pytest.raises(ValueError, match="is a PCI address"):
        GpuEntry(name=X1, match={"bdf": "0000:77:00.0"}, profile="p")
    g.configure([GpuEntry(name="spare", match={"bdf": "0000:77:00.0"}, profile="p")])
    g.observe(devs())
    assert (g.get(X1).name, g.get(X1).named, g.get(X1).profile) == (X1, False, None)


def test_a_card_that_loses_its_name_says_why(rig):
    g = started(rig)
    g.observe(devs())
    g.configure(ENTRIES[:3])  # xtx-1 gone from the config: xtx-0 keeps its card (known), the other is unnamed
    assert (g.name(X0), g.get(X0).named) == ("xtx-0", True)
    s = g.get(X1)
    assert (s.name, s.named, s.profile, s.profile_state, s.why_unnamed) == (
        X1, False, None, "none", "not identified")


def test_swapped_indexes_in_a_reload_rename_the_cards(rig):
    g = started(rig)
    g.observe(devs())
    swapped = ENTRIES[:2] + [GpuEntry(name="xtx-0", match={"pci_id": "1002:744c", "index": 1}, profile="x"),
                             GpuEntry(name="xtx-1", match={"pci_id": "1002:744c", "index": 0}, profile="x")]
    g.configure(swapped)
    assert (g.name(X0), g.name(X1)) == ("xtx-1", "xtx-0")


def test_a_reload_keeps_a_name_held_by_knowledge_not_order(rig):
    g = started(rig)
    g.observe(devs(X0))  # xtx-0 gone
    g.observe(devs(X0, extra=("0000:c0:00.0",)))  # a new XTX after xtx-1: by order it would be xtx-1
    assert (g.name(X1), g.name("0000:c0:00.0")) == ("xtx-1", "0000:c0:00.0")
    g.configure(ENTRIES)  # the same config again
    assert (g.name(X1), g.name("0000:c0:00.0")) == ("xtx-1", "0000:c0:00.0")


def test_back_elsewhere_without_a_profile(rig):
    g = rig.g
    g.configure(ENTRIES[:3] + [GpuEntry(name="xtx-1", match={"pci_id": "1002:744c", "index": 1})])
    g.observe(devs())
    g.observe(devs(X1))
    rig.said()
    g.observe(devs(X1, extra=("0000:c0:00.0",)))
    back = rig.said()[0]
    assert back[5] == f"GPU xtx-1 is back at another address: 0000:c0:00.0 (was {X1})"


def test_set_pending_makes_a_verified_card_pending_again(rig):
    g = started(rig)
    gen = g.get(X0).generation
    g.profile_result(X0, gen, True)
    assert g.set_pending(X0, "drift: sclk") == gen
    assert (g.get(X0).profile_state, g.get(X0).pending_why) == ("pending", "drift: sclk")
