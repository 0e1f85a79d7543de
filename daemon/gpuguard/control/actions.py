"""The control API's actions and who provides them. The API owns validation, auth, audit
and the confirm window; the work itself is done by providers that other parts register
on `app.state.actions` (profiles: apply/reset/snapshot/restore; engine watchdog:
kill/restart/engines; cache scan: quarantine/caches; PCIe walker: pcie). An action
without a provider answers 501 naming what is missing.

Provider contract (what each callable receives and may raise):
  apply_profile(gpu, profile, who) -> result     the profile applied AND read back
  reset_gpu(gpu, who) -> result                  back to stock OD + default power cap
                                                 (never a PCI reset; DESIGN.md safety rules)
  snapshot_state(gpu) -> state                   opaque, handed back to restore_state
  restore_state(gpu, state) -> result            write `state` back (read back)
  kill_engine(name, who) / restart_engine(name, who) -> result
  quarantine_cache(name, who) -> result          rename, never delete (INCIDENTS §7)
  engines() -> list of {"name": str, ...}        the watched engines, JSON-able
  profiles() -> list of {"name": str, ...}       the configured profiles, JSON-able
  caches() -> list[str]                          names of configured compile caches
  pcie() -> dict                                 the PCIe report, JSON-able
  power() -> dict | None                         the last power interval (policy/psu.HostPower)
  incidents() -> list of {"name": str, ...}      engine incident bundles
Raise `UnknownTarget` (404) for a name the provider does not know and `ActionRefused`
(409) for a refused action (out of range, GPU lost, ...); the message is shown as is.
Mutating providers may be coroutine functions; plain functions run in a worker thread
so a slow hardware write never blocks the event loop. Read providers run on the loop and
must only format in-memory state.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Protocol


class ActionRefused(Exception):
    """The provider refused (409): the message says why and what to do."""


class UnknownTarget(LookupError):
    """The provider does not know this GPU/engine/cache/profile (404)."""

    def __str__(self) -> str:  # LookupError would repr() a single argument
        return str(self.args[0]) if self.args else "unknown target"


class ProfileProvider(Protocol):
    def apply_profile(self, gpu: str, profile: str, who: str) -> Any: ...
    def reset_gpu(self, gpu: str, who: str) -> Any: ...
    def snapshot_state(self, gpu: str) -> Any: ...
    def restore_state(self, gpu: str, state: Any) -> Any: ...
    def profiles(self) -> list[dict[str, Any]]: ...


class EngineProvider(Protocol):
    def kill_engine(self, name: str, who: str) -> Any: ...
    def restart_engine(self, name: str, who: str) -> Any: ...
    def engines(self) -> list[dict[str, Any]]: ...


class CacheProvider(Protocol):
    def quarantine_cache(self, name: str, who: str) -> Any: ...
    def caches(self) -> list[str]: ...


class PcieProvider(Protocol):
    def pcie(self) -> dict[str, Any]: ...


@dataclass
class Actions:
    """The registry on `app.state.actions`. Register with `provide(kill_engine=fn, ...)`
    or `provide_from(obj)` (takes every method of `obj` named like a field)."""

    apply_profile: Callable[..., Any] | None = None
    reset_gpu: Callable[..., Any] | None = None
    snapshot_state: Callable[..., Any] | None = None
    restore_state: Callable[..., Any] | None = None
    kill_engine: Callable[..., Any] | None = None
    restart_engine: Callable[..., Any] | None = None
    quarantine_cache: Callable[..., Any] | None = None
    engines: Callable[[], Any] | None = None
    profiles: Callable[[], Any] | None = None
    caches: Callable[[], Any] | None = None
    pcie: Callable[[], Any] | None = None
    power: Callable[[], Any] | None = None  # fast-sampled peaks and the PSU verdict
    incidents: Callable[[], Any] | None = None

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def provide(self, **providers: Callable[..., Any]) -> None:
        for name, fn in providers.items():
            if name not in self.names():
                raise TypeError(f"no API action named {name!r}; known: {', '.join(self.names())}")
            if not callable(fn):
                raise TypeError(f"provider for {name!r} is not callable")
            setattr(self, name, fn)

    def provide_from(self, obj: object) -> list[str]:
        took = [n for n in self.names() if callable(getattr(obj, n, None))]
        self.provide(**{n: getattr(obj, n) for n in took})
        return took
