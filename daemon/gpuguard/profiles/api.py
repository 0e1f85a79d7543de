"""Profiles behind the control API (gpuguard.sinks.actions.ProfileProvider): apply a named
profile to one GPU, reset it to stock, and the snapshot/restore pair the API's
`confirm_within` window uses to revert a profile a remote user did not confirm (a user who
loses the host keeps it). Every call goes through the same Applier as the daemon's own
applies: one card at a time, validated, read back, audited with the API token's name."""
from __future__ import annotations

import asyncio
from typing import Any

from gpuguard.profiles.apply import CardResult, CardTarget, result_event
from gpuguard.profiles.schema import SETTINGS, Profile
from gpuguard.sinks.actions import ActionRefused, UnknownTarget


class ProfileActions:
    def __init__(self, runtime: Any) -> None:
        self.rt = runtime

    def _target(self, gpu: str) -> CardTarget:
        poller = self.rt.daemon.poller
        for bdf, name in poller.names.items():
            if name == gpu and bdf in poller.devices:
                if bdf in poller.lost or self.rt.daemon.hub.is_lost(bdf):
                    raise ActionRefused(f"GPU {gpu} ({bdf}) is lost: nothing is written to it until it reappears")
                return CardTarget(gpu, bdf)
        raise UnknownTarget(f"no GPU named {gpu!r}")

    async def _run(self, fn, *args) -> CardResult:
        lock = self.rt._lock or asyncio.Lock()
        self.rt.busy.add(args[0].name)
        try:
            async with lock:  # one card at a time, shared with the daemon's own applies
                r = await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        finally:
            self.rt.busy.discard(args[0].name)
        self.rt.ledger.record(r)
        self.rt._publish(result_event(r))
        self.rt._set_view()
        if not r.verified:
            raise ActionRefused(f"{r.gpu}: {r.result}: {r.message}")
        return r

    async def apply_profile(self, gpu: str, profile: str, who: str) -> dict[str, Any]:
        target = self._target(gpu)
        if profile not in self.rt.cfg.profiles:
            raise UnknownTarget(f"no profile named {profile!r} (configured: {', '.join(sorted(self.rt.cfg.profiles)) or 'none'})")
        r = await self._run(self.rt.applier.apply, target, profile, self.rt.cfg.profiles[profile], who, "API apply")
        return r.to_dict()

    async def reset_gpu(self, gpu: str, who: str) -> dict[str, Any]:
        r = await self._run(self.rt.applier.reset, self._target(gpu), who, "API reset to stock")
        return r.to_dict()

    async def snapshot_state(self, gpu: str) -> dict[str, Any]:
        target = self._target(gpu)
        reading = await asyncio.get_running_loop().run_in_executor(None, self.rt.applier.read, target)
        values = {k: v for k, v in reading.values().items() if k in SETTINGS or k == "performance_level"}
        return values

    async def restore_state(self, gpu: str, state: dict[str, Any]) -> dict[str, Any]:
        target = self._target(gpu)
        # The state was read from this card: its own values are inside its ranges, and a
        # positive voltage offset there was already the card's (not a new overvolt).
        profile = Profile(**state, allow_overvolt=state.get("vddgfx_offset_mv", 0) > 0)
        r = await self._run(self.rt.applier.apply, target, "restore", profile, "policy:confirm-window", "not confirmed in time: revert")
        return r.to_dict()

    def profiles(self) -> list[dict[str, Any]]:
        assigned: dict[str, list[str]] = {}
        for gpu, pname in self.rt.cfg.assignments.items():
            assigned.setdefault(pname, []).append(gpu)
        return [
            {"name": name, "settings": p.values(), "gpus": sorted(assigned.get(name, []))}
            for name, p in sorted(self.rt.cfg.profiles.items())
        ]
