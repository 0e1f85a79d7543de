"""Engines behind the control API (gpuguard.sinks.actions): kill or restart one engine by
name, quarantine one configured compile cache by name (rename, never delete: INCIDENTS
§7), and the read views. Each goes through the watchdog's own action code, so an API
kill is the same SIGTERM → grace → SIGKILL → verify-gone as a policy kill, audited with
the caller's token name."""
from __future__ import annotations

import asyncio
from typing import Any

from gpuguard.engines.caches import CacheError, quarantine, scan_zero_byte
from gpuguard.engines.watchdog import EngineWatchdog, _resolve_quiet
from gpuguard.sinks.actions import ActionRefused, UnknownTarget


class EngineActions:
    def __init__(self, watchdog: EngineWatchdog) -> None:
        self.wd = watchdog

    def _engine(self, name: str):
        e = self.wd._engines.get(name)
        if e is None:
            raise UnknownTarget(f"no engine named {name!r}")
        return e

    async def kill_engine(self, name: str, who: str) -> dict[str, Any]:
        e = self._engine(name)
        async with e.lock:
            procs = await asyncio.to_thread(_resolve_quiet, e.cfg)
            if procs is None:
                raise ActionRefused(f"engine {name}: no process found ({e.cfg.process.model_dump(exclude_none=True)})")
            evidence = dict(e.snapshot.evidence) if e.snapshot else {}
            res = await self.wd._kill(e, procs, "api", evidence, self.wd._clock(), who=who)
        if not res.gone:
            raise ActionRefused(f"engine {name}: processes survived SIGKILL: {list(res.survivors)}")
        return res.to_dict()

    async def restart_engine(self, name: str, who: str) -> dict[str, Any]:
        e = self._engine(name)
        if not (e.cfg.process.systemd_unit or e.cfg.restart_command):
            raise ActionRefused(f"engine {name}: no process.systemd_unit or restart_command to restart it with; "
                                "use kill, or configure one")
        async with e.lock:
            procs = await asyncio.to_thread(_resolve_quiet, e.cfg)
            return await self.wd._restart(e, procs, "api", {}, self.wd._clock(), who=who)

    def _cache(self, name: str):
        for e in self.wd._engines.values():
            for c in e.cfg.caches:
                if c.name == name:
                    return e, c
        raise UnknownTarget(f"no cache named {name!r}")

    async def quarantine_cache(self, name: str, who: str) -> dict[str, Any]:
        e, cache = self._cache(name)
        scan = await asyncio.to_thread(scan_zero_byte, cache.path)
        try:
            target = await asyncio.to_thread(quarantine, cache.path, "api")
        except CacheError as exc:
            raise ActionRefused(f"cache {name}: {exc}") from None
        now = self.wd._clock()
        self.wd._actions[(e.cfg.name, "quarantine", "api")] += 1
        self.wd._audit(e, "quarantine", "api", who,
                       {"cache": name, "zero_byte_files": scan.zero_byte_files, "files": scan.files},
                       {"from": str(cache.path), "to": str(target)}, now)
        return {"from": str(cache.path), "to": str(target), "zero_byte_files": scan.zero_byte_files}

    def engines(self) -> list[dict[str, Any]]:
        snaps = self.wd.snapshots()
        return [snaps[n].to_dict() if n in snaps else {"name": n, "state": "unknown"} for n in sorted(self.wd._engines)]

    def incidents(self) -> list[dict[str, Any]]:
        """Incident bundles under state_dir/incidents, oldest first."""
        return self.wd.incidents.list() if self.wd.incidents is not None else []

    def caches(self) -> list[str]:
        return sorted(c.name for e in self.wd._engines.values() for c in e.cfg.caches)
