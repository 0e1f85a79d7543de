"""Engines behind the control API (control/actions.py): kill or restart one engine by
name, quarantine one configured compile cache by name (rename, never delete: INCIDENTS
§7), and the read views. Each goes through the watchdog's own action code, so an API
kill is the same SIGTERM → grace → SIGKILL → verify-gone as a policy kill, audited with
the caller's token name; this side turns names and refusals into the API's answers."""
from __future__ import annotations

from typing import Any

from gpuguard.control.actions import ActionRefused, UnknownTarget
from gpuguard.engines.caches import CacheError
from gpuguard.engines.config import EngineConfig
from gpuguard.engines.process import ProcessLookupFailed
from gpuguard.engines.watchdog import EngineWatchdog


class EngineActions:
    def __init__(self, watchdog: EngineWatchdog) -> None:
        self.wd = watchdog

    def _engine(self, name: str) -> EngineConfig:
        cfg = self.wd.engine_config(name)
        if cfg is None:
            raise UnknownTarget(f"no engine named {name!r}")
        return cfg

    async def kill_engine(self, name: str, who: str) -> dict[str, Any]:
        cfg = self._engine(name)
        try:
            res = await self.wd.kill_asked(name, who)
        except ProcessLookupFailed as exc:  # found, but not the engine's to kill: why, nothing signalled
            raise ActionRefused(f"engine {name}: {exc}") from None
        if res is None:
            raise ActionRefused(f"engine {name}: no process found ({cfg.process.model_dump(exclude_none=True)})")
        if res.refused:
            raise ActionRefused(f"engine {name}: not signalled: {'; '.join(res.refused)}"
                                + (f"; signalled and gone: {list(res.pids)}" if res.pids and not res.survivors else ""))
        if not res.gone:
            raise ActionRefused(f"engine {name}: processes survived SIGKILL: {list(res.survivors)}")
        return res.to_dict()

    async def restart_engine(self, name: str, who: str) -> dict[str, Any]:
        cfg = self._engine(name)
        if not (cfg.process.systemd_unit or cfg.restart_command):
            raise ActionRefused(f"engine {name}: no process.systemd_unit or restart_command to restart it with; "
                                "use kill, or configure one")
        out = await self.wd.restart_asked(name, who)
        cmd = out.get("command") or {}
        if cmd and cmd.get("returncode") != 0:  # the engine was not restarted: never answered "ok"
            how = (f"exited {cmd['returncode']}" if cmd.get("returncode") is not None else cmd.get("output", "failed"))
            tail = (cmd.get("output") or "").strip().splitlines()[-1:] if cmd.get("returncode") is not None else []
            raise ActionRefused(f"engine {name}: restart command {' '.join(cmd.get('argv', []))} {how}"
                                + (f": {tail[0]}" if tail else ""))
        return out

    async def quarantine_cache(self, name: str, who: str) -> dict[str, Any]:
        if name not in self.wd.cache_owners():
            raise UnknownTarget(f"no cache named {name!r}")
        try:
            return await self.wd.quarantine_asked(name, who)
        except CacheError as exc:
            raise ActionRefused(f"cache {name}: {exc}") from None

    def engines(self) -> list[dict[str, Any]]:
        snaps = self.wd.snapshots()
        return [snaps[n].to_dict() if n in snaps else {"name": n, "state": "unknown"} for n in self.wd.engine_names()]

    def incidents(self) -> list[dict[str, Any]]:
        """Incident bundles under state_dir/incidents, oldest first."""
        return self.wd.incidents.list() if self.wd.incidents is not None else []

    def caches(self) -> list[str]:
        return sorted(self.wd.cache_owners())
