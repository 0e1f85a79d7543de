"""NVIDIA profiles through NVML against a fake NVML writer that enforces NVML's own rules
(tests/nvml/fake_nvml.py, seeded with the H200's real constraints): validation before any
write, one card at a time, read-back, retry, reset, the driver's refusals reported with
its reason, a card that appears late and one that refuses."""
from __future__ import annotations

import asyncio

from gpuguard.cli.apply import render
from gpuguard.hw.nvml import NvmlSource
from gpuguard.profiles.nvidia import NvmlApplier, apply_all
from gpuguard.profiles.apply import result_event
from gpuguard.profiles.schema import Bounds, Profile

from .fake_nvml import FakeCard, FakeNvml

A, B = "0000:19:00.0", "0000:3b:00.0"


def cards(**kw) -> list[FakeCard]:
    return [FakeCard(A, "GPU-a", **kw), FakeCard(B, "GPU-b")]


def applier(nv: FakeNvml, audit: list | None = None, **kw) -> NvmlApplier:
    return NvmlApplier(nv, audit=(audit.append if audit is not None else None), sleep=lambda s: None, **kw)


def test_power_cap_and_locked_clocks_apply_and_read_back():
    nv = FakeNvml(cards())
    audit: list = []
    r = applier(nv, audit).apply(0, "gpu0", A, "quiet", Profile(power_cap_w=450, sclk_min_mhz=1410, sclk_max_mhz=1410,
                                                                 mclk_max_mhz=2201), "test", "boot")
    assert r.verified and r.result == "ok", r
    assert r.readback["power_cap_w"] == 450
    assert r.readback["sclk_locked_mhz"] == "1410-1410" and r.readback["mclk_locked_mhz"] == "2201-2201"
    assert r.before["power_cap_w"] == 700
    assert [w[1] for w in nv.writes] == ["nvmlDeviceSetPowerManagementLimit", "nvmlDeviceSetGpuLockedClocks",
                                         "nvmlDeviceSetMemoryLockedClocks"]
    assert [a["action"] for a in audit] == ["write", "write", "write", "verified"]
    assert result_event(r).kind == "profile_applied"
    table = render([r.to_dict()])
    assert "VERIFIED" in table and "power_cap_w" in table and "nvmlDeviceSetGpuLockedClocks(1410, 1410)" in table


def test_values_outside_the_cards_constraints_write_nothing():
    nv = FakeNvml(cards())
    ap = applier(nv)
    r = ap.apply(0, "gpu0", A, "hot", Profile(power_cap_w=800), "test", "boot")
    assert r.result == "refused" and not r.verified
    assert "outside the card's 200-700 W" in r.message and "Constraints" in r.message
    r = ap.apply(0, "gpu0", A, "fast", Profile(sclk_max_mhz=2100), "test", "boot")
    assert r.result == "refused" and "345-1980 MHz" in r.message
    r = ap.apply(0, "gpu0", A, "mem", Profile(mclk_max_mhz=1000), "test", "boot")
    assert r.result == "refused" and "2201-3201" in r.message
    r = ap.apply(0, "gpu0", A, "env", Profile(power_cap_w=650, envelope={"power_cap_w": Bounds(max=600)}), "t", "b")
    assert r.result == "refused" and "envelope" in r.message
    r = ap.apply(0, "gpu0", A, "amd", Profile(sclk_offset_mhz=-100), "test", "boot")
    assert r.result == "config" and "no NVML equivalent" in r.message
    assert nv.writes == []


def test_a_limit_that_reads_back_different_is_retried_then_unverified():
    nv = FakeNvml(cards(external_limit_mw=600_000))  # a host/board limit holds 600 W
    r = applier(nv, retries=2).apply(0, "gpu0", A, "p", Profile(power_cap_w=650), "test", "boot")
    assert r.result == "mismatch" and not r.verified and r.attempts == 3
    assert r.readback["power_cap_w"] == 600
    assert "power_cap_w wrote 650 read 600" in r.message
    assert len(nv.writes) == 3  # written, read back, re-written twice: then left alone
    ev = result_event(r)
    assert ev.kind == "profile_unverified" and ev.severity == "alert"
    assert "≠" in render([r.to_dict()])


def test_not_root_is_refused_with_nvmls_reason():
    nv = FakeNvml(cards(), root=False)
    r = applier(nv).apply(0, "gpu0", A, "p", Profile(power_cap_w=500), "test", "boot")
    assert r.result == "refused" and not r.verified and r.attempts == 1
    assert "NVMLError_NoPermission" in r.message
    assert result_event(r).kind == "profile_unverified"


def test_locked_clocks_not_supported_stop_the_card_with_the_reason():
    nv = FakeNvml([FakeCard(A, "GPU-a", supports_locked_clocks=False)])
    r = applier(nv).apply(0, "gpu0", A, "p", Profile(power_cap_w=500, sclk_min_mhz=1200, sclk_max_mhz=1500), "t", "b")
    assert r.result == "refused" and "NVMLError_NotSupported" in r.message
    assert r.written == ("nvmlDeviceSetPowerManagementLimit(500000)",)


def test_clock_held_below_the_locked_minimum_names_the_reason():
    nv = FakeNvml([FakeCard(A, "GPU-a", loaded=True)])
    r = applier(nv, retries=1).apply(0, "gpu0", A, "p", Profile(sclk_min_mhz=1755, sclk_max_mhz=1755), "t", "b")
    assert not r.verified and r.result == "mismatch"
    assert r.readback["sclk_locked_mhz"] == "1440 now (sw_power_cap)"


def test_reset_restores_default_limit_and_unlocks_clocks():
    nv = FakeNvml(cards())
    ap = applier(nv)
    assert ap.apply(0, "gpu0", A, "p", Profile(power_cap_w=400, sclk_min_mhz=1000, sclk_max_mhz=1200), "t", "b").verified
    r = ap.reset(0, "gpu0", A, "t", "reset")
    assert r.verified and r.readback["power_cap_w"] == 700
    c = nv.cards[0]
    assert c.gpu_locked is None and c.mem_locked is None and c.limit_mw == 700_000


def test_lost_card_is_not_written():
    nv = FakeNvml([FakeCard(A, "GPU-a", lost=True)])
    r = applier(nv).apply(0, "gpu0", A, "p", Profile(power_cap_w=400), "t", "b")
    assert r.result == "lost" and nv.writes == []
    nv2 = FakeNvml(cards())
    r = applier(nv2, is_lost=lambda bdf: bdf == A).apply(0, "gpu0", A, "p", Profile(power_cap_w=400), "t", "b")
    assert r.result == "lost" and nv2.writes == []


def test_late_card_is_waited_for_and_a_refusing_card_does_not_stop_the_others():
    # card B shows up only after a few discoveries (INCIDENTS §2); card A refuses locked
    # clocks (NotSupported, as in a VM). Both are attempted, one at a time, in PCI order.
    nv = FakeNvml([FakeCard(A, "GPU-a", supports_locked_clocks=False), FakeCard(B, "GPU-b")], appears_after={1: 3})
    src = NvmlSource(nv)
    names = {A: "gpu0", B: "gpu1"}
    prof = {"locked": Profile(power_cap_w=500, sclk_min_mhz=1410, sclk_max_mhz=1410)}
    results = asyncio.run(apply_all(applier(nv), src.discover, {"gpu0": "locked", "gpu1": "locked"}, prof,
                                    lambda d: names[d.bdf], "test", "boot", wanted=2, timeout=30, interval=0.01))
    assert [(r.gpu, r.result) for r in results] == [("gpu0", "refused"), ("gpu1", "ok")]
    assert nv.count_calls == 3  # two discoveries saw one card; the third found the late one
    # one card at a time: every write of A comes before any of B
    order = [w[0] for w in nv.writes]
    assert order == sorted(order) and set(order) == {0, 1}
    table = render([r.to_dict() for r in results])
    assert "gpu0 (0000:19:00.0) profile locked: NOT VERIFIED (refused)" in table
    assert "gpu1 (0000:3b:00.0) profile locked: VERIFIED" in table


def test_dry_run_plans_without_writing():
    nv = FakeNvml(cards())
    r = applier(nv).apply(0, "gpu0", A, "p", Profile(power_cap_w=450, mclk_max_mhz=3201), "t", "b", dry_run=True)
    assert r.result == "dry-run" and nv.writes == []
    assert r.planned == ("nvmlDeviceSetPowerManagementLimit(450000)", "nvmlDeviceSetMemoryLockedClocks(2201, 3201)")


def test_mixed_host_routes_nvidia_cards_through_nvml_and_the_rest_to_amdgpu():
    from gpuguard.profiles.nvidia import VendorApplier, host_nvidia
    from gpuguard.profiles.apply import CardResult, CardTarget

    class Amd:  # stands for the amdgpu Applier: records which cards reached it
        def __init__(self):
            self.seen = []

        def apply(self, target, pname, profile, who, why, dry_run=False):
            self.seen.append(target.bdf)
            return CardResult(target.name, target.bdf, pname, "ok", True, "amdgpu")

        reset = None

    nv = FakeNvml([FakeCard(B, "GPU-b")])
    amd = Amd()
    va = VendorApplier(amd, applier(nv), NvmlSource(nv).discover())
    r_amd = va.apply(CardTarget("r9700", "0000:03:00.0"), "p", Profile(power_cap_w=250), "t", "b")
    r_nv = va.apply(CardTarget("h200", B), "p", Profile(power_cap_w=450), "t", "b")
    assert amd.seen == ["0000:03:00.0"] and r_amd.message == "amdgpu"
    assert r_nv.verified and nv.writes == [(0, "nvmlDeviceSetPowerManagementLimit", (450000,))]
    assert va.reset(CardTarget("h200", B), "t", "r").readback["power_cap_w"] == 700
    # a simulated tree never reaches for NVML
    assert host_nvidia("/tmp/some-sim-tree") == ([], None)


def test_an_index_that_names_another_card_now_writes_nothing_and_names_both():
    # Card A left (or one appeared before it): index 1 that was A's is B's now. The applier
    # is handed A's address with the old index; writing there would set the card next
    # door (INCIDENTS §2: the glob matched one card).
    nv = FakeNvml(cards())
    audit: list = []
    r = applier(nv, audit).apply(1, "gpu0", A, "quiet", Profile(power_cap_w=450), "test", "boot")
    assert r.result == "error" and not r.verified, r
    assert A in r.message and B in r.message, r.message
    assert nv.writes == []
    assert [a for a in audit if a.get("action") == "write"] == []
    r = applier(nv, audit).reset(1, "gpu0", A, "test", "reset")
    assert r.result == "error" and nv.writes == [] and not any(a.get("action") == "write" for a in audit)
