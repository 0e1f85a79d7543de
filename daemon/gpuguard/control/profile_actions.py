"""Profiles behind the control API (gpuguard.control.actions.ProfileProvider): apply a named
profile to one GPU, reset it to stock, and the snapshot/restore pair the API's
`confirm_within` window uses to revert a profile a remote user did not confirm (a user who
loses the host keeps it). Every call goes through the same Applier as the daemon's own
applies: one card at a time, validated, read back, audited with the API token's name."""
from __future__ import annotations

from typing import Any

from gpuguard.control.actions import ActionRefused, UnknownTarget
from gpuguard.profiles.apply import CardResult, CardTarget
from gpuguard.profiles.schema import SETTINGS, Profile


class ProfileActions:
    def __init__(self, runtime: Any) -> None:
        self.rt = runtime

    def _target(self, gpu: str) -> CardTarget:
        gpus = self.rt.gpus
        bdf = gpus.bdf_of(gpu)
        s = gpus.get(bdf) if bdf else None
        if s is None or not s.on_bus:
            raise UnknownTarget(f"no GPU named {gpu!r}")
        if not gpus.may_write(bdf):
            why = f"is {s.presence.replace('_', ' ')}" if not s.up else (
                "is not identified (" + (s.why_unnamed or "no configured name") + ")" if not s.named else "may not be written")
            raise ActionRefused(f"GPU {s.name} ({bdf}) {why}: nothing is written to it")
        return CardTarget(s.name, bdf)

    async def _run(self, fn, *args) -> CardResult:
        target = args[0]
        self.rt.busy.add(target.bdf)
        try:
            r = await self.rt.on_card(fn, *args)  # one card at a time, shared with the daemon's applies
        finally:
            self.rt.busy.discard(target.bdf)
        self.rt.record(r)
        # The GPU's state says whether its card holds its configured profile now, read back:
        # an API apply of another profile makes it unverified, a revert to it verified again.
        s = self.rt.gpus.get(target.bdf)
        if s is not None and s.profile is not None and r.result != "dry-run":
            self.rt.gpus.card_holds(target.bdf, r.verified and r.profile == s.profile)
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
        from gpuguard.profiles.nvidia import NvmlRevertUnsupported

        target = self._target(gpu)
        try:
            reading = await self.rt.calls.run(self.rt.applier.read, target, timeout=self.rt.cfg.apply.timeout_seconds)
        except NvmlRevertUnsupported as e:
            raise ActionRefused(str(e)) from None
        values: dict[str, Any] = {k: v for k, v in reading.values().items() if k in SETTINGS or k == "performance_level"}
        # the profile those values are (None: stock or not known), so a revert says what it restored
        values["profile"] = self.rt.ledger.profile_in_effect(target.name)[1]
        return values

    async def restore_state(self, gpu: str, state: dict[str, Any]) -> dict[str, Any]:
        target = self._target(gpu)
        values = {k: v for k, v in state.items() if k != "profile"}
        # The state was read from this card: its own values are inside its ranges, and a
        # positive voltage offset there was already the card's (not a new overvolt).
        profile = Profile(**values, allow_overvolt=values.get("vddgfx_offset_mv", 0) > 0)
        # recorded under the name of the profile those values were ("restore" when not known)
        name = state.get("profile") or "restore"
        r = await self._run(self.rt.applier.apply, target, name, profile, "policy:confirm-window", "not confirmed in time: revert")
        return r.to_dict()

    def profiles(self) -> list[dict[str, Any]]:
        assigned: dict[str, list[str]] = {}
        for gpu, pname in self.rt.cfg.assignments.items():
            assigned.setdefault(pname, []).append(gpu)
        return [
            {"name": name, "settings": p.values(), "gpus": sorted(assigned.get(name, []))}
            for name, p in sorted(self.rt.cfg.profiles.items())
        ]
