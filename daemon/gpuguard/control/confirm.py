"""The confirm window of `POST /v1/gpus/{gpu}/apply` with `confirm_within: N`: the GPU's
state before the apply is kept, and unless `POST /v1/gpus/{gpu}/confirm` arrives within
N seconds it is written back through `restore_state`. A remote user whose new profile
takes the host down (INCIDENTS §2: a power trip; §10: no BMC) gets the old state back
without touching the machine. (LACT does the same with a fixed 5 s.)

A second apply while a window is open keeps the state from before the *first* one, so
the revert always returns to the last confirmed state. Applies to one GPU take `sequence`
from reading the state before to opening the window, and a revert takes it too: 24
concurrent applies each read "the state before" while the others were writing, and the
revert put back one of the unconfirmed profiles.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from gpuguard.state.audit import AuditLog
from gpuguard.state.events import Event
from gpuguard.state.hub import Hub

log = logging.getLogger("gpuguard.confirm")


@dataclass
class PendingApply:
    gpu: str
    profile: str
    who: str
    state: Any  # from snapshot_state, before the first unconfirmed apply
    seconds: float
    deadline: float  # wall time
    task: asyncio.Task | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "profile": self.profile,
            "who": self.who,
            "confirm_within": self.seconds,
            "revert_at": self.deadline,
        }


class ConfirmWindows:
    def __init__(self, hub: Hub, audit: AuditLog | None, restore: Callable[[], Callable[..., Any] | None]) -> None:
        self.hub = hub
        self.audit = audit
        self._restore = restore  # looked up at revert time: providers may register late
        self.pending: dict[str, PendingApply] = {}
        self._sequences: dict[str, asyncio.Lock] = {}

    def sequence(self, gpu: str) -> asyncio.Lock:
        """Held by an apply from reading the state before to opening its window, and by a revert."""
        return self._sequences.setdefault(gpu, asyncio.Lock())

    def state_before(self, gpu: str) -> Any | None:
        """The state a revert would restore if a window is already open for `gpu`."""
        p = self.pending.get(gpu)
        return p.state if p else None

    def has(self, gpu: str) -> bool:
        return gpu in self.pending

    def open(self, gpu: str, profile: str, who: str, state: Any, seconds: float) -> PendingApply:
        old = self.pending.pop(gpu, None)
        if old is not None:
            if old.task is not None:
                old.task.cancel()
            state = old.state
        p = PendingApply(gpu, profile, who, state, seconds, time.time() + seconds)
        p.task = asyncio.get_running_loop().create_task(self._expire(p), name=f"confirm {gpu}")
        self.pending[gpu] = p
        return p

    def confirm(self, gpu: str) -> PendingApply | None:
        p = self.pending.pop(gpu, None)
        if p is not None and p.task is not None:
            p.task.cancel()
        return p

    def close(self) -> None:
        """Shutdown: cancel the timers. The unconfirmed state stays applied; a restart
        applies the configured profile anyway."""
        for p in self.pending.values():
            if p.task is not None:
                p.task.cancel()
        self.pending.clear()

    async def _expire(self, p: PendingApply) -> None:
        await asyncio.sleep(p.seconds)
        async with self.sequence(p.gpu):
            if self.pending.get(p.gpu) is not p:
                return
            del self.pending[p.gpu]
            await self._revert(p)

    async def _revert(self, p: PendingApply) -> None:
        why = f"profile {p.profile!r} was not confirmed within {p.seconds:g} s"
        restore = self._restore()
        result: Any = None
        try:
            if restore is None:
                raise RuntimeError("no restore_state provider is registered")
            if inspect.iscoroutinefunction(restore):
                result = await restore(p.gpu, p.state)
            else:
                result = await asyncio.to_thread(restore, p.gpu, p.state)
            outcome = "ok"
            self.hub.publish(
                Event("profile_reverted", "warning", "api", f"GPU {p.gpu}: {why}; previous state restored", gpu=p.gpu,
                      fields={"profile": p.profile, "who": p.who})
            )
        except Exception as e:  # the revert failing is an alert, never a crash of the loop
            outcome = f"failed: {type(e).__name__}: {e}"
            self.hub.publish(
                Event("profile_revert_failed", "alert", "api", f"GPU {p.gpu}: {why}; restoring the previous state "
                      f"failed: {e}", gpu=p.gpu, fields={"profile": p.profile, "who": p.who})
            )
        log.warning("confirm window expired gpu=%s profile=%s who=%s revert=%s", p.gpu, p.profile, p.who, outcome)
        if self.audit is not None:
            self.audit.record(
                "gpu.revert", p.who, why, target=p.gpu, result=outcome,
                evidence={"profile": p.profile, "restored_state": p.state, "provider_result": result},
            )
