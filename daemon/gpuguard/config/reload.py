"""What a SIGHUP reload may change in place, and what only a restart can (the
log said "applied" while `kernel:` and `engines:` changes were ignored).

`plan_reload(old, new, live_sections)` compares two validated configs key by key and
sorts every changed key into "applied live" or "needs restart". The effective config
keeps the running value of every key that needs a restart, so what the daemon reports
is what it runs. Sections this module does not know (added by a later feature) need a
restart until that feature says otherwise: never "applied" for what was not applied.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from pydantic import BaseModel

# section -> keys that only take effect at a restart (None: the whole section)
RESTART_KEYS: dict[str, frozenset[str] | None] = {
    "sysfs_root": None,
    "state_dir": None,
    "listen": None,  # the bound socket
    "recorder": frozenset({"enabled", "path"}),  # the open database
    "kernel": frozenset({"enabled", "kmsg_path", "state_file", "udev", "udev_source", "event_buffer"}),
    "api": frozenset({"unix_socket"}),
    # consulted once, at start (the wait for late cards, the safe-mode decision): a running
    # daemon has nothing to apply them to, so a reload must not call them applied
    "apply": frozenset({"wait_for_gpus", "wait_timeout_seconds", "safe_mode_after_crashes"}),
}
# sections the daemon applies in place (the keys of RESTART_KEYS sections not listed there too)
LIVE_SECTIONS = frozenset({"poll", "gpus", "logging", "webhooks", "profiles", "apply", "kernel", "api", "recorder",
                           "power"})


@dataclass
class ReloadPlan:
    changed: list[str] = field(default_factory=list)  # "section" or "section.key"
    live: list[str] = field(default_factory=list)
    restart: list[str] = field(default_factory=list)
    effective: Any = None  # the config to run: new, with restart-needing keys kept as they were

    @property
    def sections_live(self) -> set[str]:
        return {k.split(".", 1)[0] for k in self.live}


def _keys(old: Any, new: Any) -> list[str]:
    if isinstance(old, BaseModel) and isinstance(new, BaseModel) and type(old) is type(new):
        return [k for k in type(old).model_fields if getattr(old, k) != getattr(new, k)]
    return [] if old == new else [""]


def plan_reload(old: BaseModel, new: BaseModel, live_sections: Iterable[str] = LIVE_SECTIONS) -> ReloadPlan:
    live_sections = set(live_sections)
    plan = ReloadPlan()
    keep: dict[str, Any] = {}
    for section in type(new).model_fields:
        o, n = getattr(old, section), getattr(new, section)
        if o == n:
            continue
        keys = _keys(o, n)
        names = [f"{section}.{k}" if k else section for k in keys]
        plan.changed += names
        restart_keys = RESTART_KEYS.get(section, frozenset())
        if section not in live_sections or restart_keys is None:
            plan.restart += names
            keep[section] = o
            continue
        stay = [k for k in keys if k in restart_keys]
        plan.restart += [f"{section}.{k}" for k in stay]
        plan.live += [f"{section}.{k}" if k else section for k in keys if k not in stay]
        if stay:
            keep[section] = n.model_copy(update={k: getattr(o, k) for k in stay})
    plan.effective = new.model_copy(update=keep) if keep else new
    return plan
