"""Random lives of a host's GPUs (hypothesis state machine) over the real GpuStates, the
real lost/back policy and the real profile runtime (its reconcile loop, its device-call
threads, its may_write check), with a writer that checks every write as it happens:

- never a write to a card that is lost, gone from the bus, not answering or unnamed;
- a lost card on the bus is back once it answered every read for lost_after_seconds;
- no card ever gets another card's profile (the profile written is the one the current
  config assigns to the card's true identity; XTX cards are identified by order);
- after things settle, every present card is verified, or alerted (not answering, or
  named in a `gpus_missing` alert).
"""
from __future__ import annotations

import asyncio
import threading

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gpuguard.config.schema import Config
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.policy.gpu_lifecycle import GpuLifecycle
from gpuguard.profiles.apply import CardResult
from gpuguard.profiles.lifecycle import ProfileRuntime
from gpuguard.profiles.schema import ProfilesConfig
from gpuguard.state.hub import Hub
import pytest

pytestmark = [pytest.mark.slow]  # registered in pyproject.toml


# physical cards: (home address, pci device id, true name); an XTX may come back at one
# other address that keeps the order of the two XTX (index order is what names them)
CARDS = {
    "r-a": ("0000:05:00.0", "7551", "r9700-a"),
    "r-b": ("0000:08:00.0", "7551", "r9700-b"),
    "x-0": ("0000:aa:00.0", "744c", "xtx-0"),
    "x-1": ("0000:b0:00.0", "744c", "xtx-1"),
}
ALT = {"x-0": "0000:a0:00.0", "x-1": "0000:c0:00.0"}


def config(swap: bool) -> Config:
    p0, p1 = ("xtx-2000", "xtx-1500") if swap else ("xtx-1500", "xtx-2000")
    return Config(
        profiles={"psu-safe": {"power_cap_w": 210}, "xtx-1500": {"sclk_max_mhz": 1500},
                  "xtx-2000": {"sclk_max_mhz": 2000}},
        gpus=[
            {"name": "r9700-a", "match": {"bdf": "0000:05:00.0"}, "profile": "psu-safe"},
            {"name": "r9700-b", "match": {"bdf": "0000:08:00.0"}, "profile": "psu-safe"},
            {"name": "xtx-0", "match": {"pci_id": "1002:744c", "index": 0}, "profile": p0},
            {"name": "xtx-1", "match": {"pci_id": "1002:744c", "index": 1}, "profile": p1},
        ],
    )


class Dev:
    def __init__(self, bdf: str, device_id: str) -> None:
        self.bdf, self.vendor, self.device_id, self.model = bdf, "1002", device_id, "?"


class Guard:
    def decide(self):
        return type("D", (), {"safe": False, "reason": ""})()

    def record_apply(self) -> None: ...
    def heartbeat(self) -> None: ...
    def record_clean_stop(self) -> None: ...


class CheckingWriter:
    """Stands in for the Applier: every 'write' checks the host and the state owner."""

    def __init__(self, machine: "GpuLives") -> None:
        self.m = machine
        self.lock = threading.Lock()
        self.violations: list[str] = []
        self.writes: list[tuple[str, str, str]] = []  # (physical card, bdf, profile)

    def apply(self, target, profile_name, profile, who, why, dry_run=False) -> CardResult:
        m = self.m
        with self.lock:
            card = m.card_at(target.bdf)
            if not m.gpus.may_write(target.bdf):
                self.violations.append(f"apply ran although may_write({target.bdf}) is False")
            elif card is None:
                self.violations.append(f"write to {target.bdf}: no card there")
            elif card in m.silent or card in m.lost:
                self.violations.append(f"write to {card} ({target.bdf}) which is not answering / lost")
            else:
                want = m.profile_for(CARDS[card][2])
                if profile_name != want:
                    self.violations.append(f"{card} ({target.bdf}, true name {CARDS[card][2]}) got {profile_name}, "
                                           f"its profile is {want}")
                self.writes.append((card, target.bdf, profile_name))
                m.carried[card] = profile_name
        return CardResult(target.name, target.bdf, profile_name, "ok", True, "read back equal", attempts=1)


@settings(max_examples=150, stateful_step_count=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
class GpuLives(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.tmp = tempfile.TemporaryDirectory()
        self.loop = asyncio.new_event_loop()
        self.now = 0.0
        self.swap = False
        self.cfg = config(self.swap)
        self.hub = Hub()
        self.gpus = self.hub.gpus
        self.gpus.clock = lambda: self.now
        self.gpus.lost_after_seconds = 10
        self.gpus.configure(self.cfg.gpus)
        self.lifecycle = GpuLifecycle(self.gpus, kill=lambda *a: None, restart=lambda *a: None)
        self.present: dict[str, str] = {c: home for c, (home, _, _) in CARDS.items()}  # card -> address
        self.silent: set[str] = set()  # on the bus, not answering
        self.quiet_since: dict[str, float] = {}  # silent card -> when its first read failed
        # lost card on the bus -> since when every read answered (None: the last one failed);
        # back after lost_after_seconds of that, whatever lost it (state/gpus.py)
        self.lost: dict[str, float | None] = {}
        self.carried: dict[str, str] = {}  # card -> profile it carries (stock after a reset/return)
        self.writer = CheckingWriter(self)
        pc = ProfilesConfig.from_root(self.cfg).model_copy(update={"state_dir": self.tmp.name})
        self.rt = ProfileRuntime(pc, self.gpus, self.hub, SysfsRoot(self.tmp.name), applier=self.writer, guard=Guard())
        self.run(self._start())

    # -- helpers ----------------------------------------------------------------------------
    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def _start(self) -> None:
        self.discover()
        await self.rt.on_ready()

    def card_at(self, bdf: str) -> str | None:
        return next((c for c, a in self.present.items() if a == bdf), None)

    def profile_for(self, name: str) -> str | None:
        return next((g.profile for g in self.cfg.gpus if g.name == name), None)

    def discover(self) -> None:
        async def look() -> None:  # on the loop, as the poller does it
            self.gpus.observe([Dev(a, CARDS[c][1]) for c, a in sorted(self.present.items())])

        if self.loop.is_running():
            self.gpus.observe([Dev(a, CARDS[c][1]) for c, a in sorted(self.present.items())])
        else:
            self.run(look())

    async def _settle(self) -> None:
        # one poll cycle: reads (answering or not), then the reconcile, then the applies finish
        for c, a in sorted(self.present.items()):
            if c in self.silent:
                self.gpus.not_answering(a, "read timed out")
                if c in self.lost:
                    self.lost[c] = None
                elif self.now - self.quiet_since.setdefault(c, self.now) >= 10:
                    self.lost[c] = None
                    del self.quiet_since[c]
            else:
                self.gpus.answering(a)
                self.quiet_since.pop(c, None)
                if c in self.lost:
                    since = self.lost[c] = self.now if self.lost[c] is None else self.lost[c]
                    if self.now - since >= 10:
                        del self.lost[c]
        self.rt.reconcile()
        for _ in range(20):
            if not self.rt._tasks:
                break
            await asyncio.gather(*list(self.rt._tasks), return_exceptions=True)
        await asyncio.sleep(0)

    def settle(self) -> None:
        self.run(self._settle())

    # -- rules ------------------------------------------------------------------------------
    @precondition(lambda self: self.present)
    @rule(data=st.data())
    def vanish(self, data) -> None:
        card = data.draw(st.sampled_from(sorted(self.present)))
        del self.present[card]
        self.silent.discard(card)
        self.quiet_since.pop(card, None)
        self.lost.pop(card, None)
        self.discover()
        self.settle()

    @precondition(lambda self: len(self.present) < len(CARDS))
    @rule(data=st.data(), elsewhere=st.booleans())
    def reappear(self, data, elsewhere: bool) -> None:
        card = data.draw(st.sampled_from(sorted(set(CARDS) - set(self.present))))
        self.present[card] = ALT[card] if elsewhere and card in ALT else CARDS[card][0]
        self.carried.pop(card, None)  # back at stock settings
        self.discover()
        self.settle()

    @precondition(lambda self: self.present)
    @rule(data=st.data())
    def kernel_loses(self, data) -> None:
        card = data.draw(st.sampled_from(sorted(self.present)))
        self.lost[card] = None
        self.quiet_since.pop(card, None)

        async def lose() -> None:  # on the loop, as the kernel router does it
            self.gpus.mark_lost(self.present[card], "kmsg:device_lost")

        self.run(lose())
        self.settle()

    @precondition(lambda self: self.present)
    @rule(data=st.data())
    def reset(self, data) -> None:
        card = data.draw(st.sampled_from(sorted(self.present)))
        if self.lost.pop(card, "present") != "present":  # a lost card is back: counted anew
            self.quiet_since.pop(card, None)
        self.carried.pop(card, None)

        async def reset() -> None:
            self.gpus.reset(self.present[card], "kernel: GPU reset succeeded")

        self.run(reset())
        self.settle()

    @precondition(lambda self: self.present)
    @rule(data=st.data(), seconds=st.sampled_from([1.0, 11.0]))
    def stops_answering(self, data, seconds: float) -> None:
        card = data.draw(st.sampled_from(sorted(self.present)))
        self.silent.add(card)
        self.settle()
        self.now += seconds
        self.settle()

    @precondition(lambda self: self.silent)
    @rule(data=st.data())
    def answers_again(self, data) -> None:
        card = data.draw(st.sampled_from(sorted(self.silent)))
        self.silent.discard(card)
        self.settle()

    @rule()
    def sighup_reload(self) -> None:
        self.swap = not self.swap
        self.cfg = config(self.swap)
        with self.writer.lock:  # the config changes between writes, never during one
            self.gpus.configure(self.cfg.gpus)
            self.rt.configure(ProfilesConfig.from_root(self.cfg).model_copy(update={"state_dir": self.tmp.name}))
        self.settle()

    @rule()
    def poll_cycle(self) -> None:
        self.discover()
        self.settle()

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def no_bad_write(self) -> None:
        assert self.writer.violations == []

    @invariant()
    def every_present_card_verified_or_alerted(self) -> None:
        self.settle()
        missing = {m.name for m in self.gpus.missing()}
        for card, bdf in self.present.items():
            s = self.gpus.get(bdf)
            assert s is not None and s.on_bus, (card, bdf)
            if card in self.silent or card in self.lost:
                assert not self.gpus.may_write(bdf)
                continue
            assert not self.gpus.is_lost(bdf), f"{card} at {bdf} still lost after answering for 10 s"
            if not s.named:
                assert missing, f"{card} at {bdf} unnamed without a gpus_missing alert"
                assert ("host", "gpus_missing") in self.gpus.conditions
                continue
            assert s.name == CARDS[card][2], f"{card} at {bdf} named {s.name}"
            assert s.profile_state == "verified", (card, s)
            assert self.carried.get(card) == self.profile_for(s.name), (card, self.carried.get(card))

    def teardown(self) -> None:
        self.rt.begin_stop()
        self.run(self.lifecycle.aclose())
        self.loop.close()
        self.tmp.cleanup()


TestGpuLives = GpuLives.TestCase
