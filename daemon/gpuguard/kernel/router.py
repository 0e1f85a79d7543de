"""Kernel and device events → actions: owns what gpuguard does when the kernel speaks.
Classifies kmsg records and udev device events, keeps the bounded event list, and
reports into the GPU state owner (`state/gpus.py`): the per-(gpu, kind) counters
(`gpuguard_kernel_events_total`, GPU-less lines under gpu="host"), the conditions that
hold (a lost GPU, a failed reset), lost and back. Then it calls the policy hooks.

The hooks' real implementations live elsewhere (profiles, engine watchdog, notifier);
this module only decides when to call them. A hook may be sync or async; one that raises
is logged and never stops the router. One incident prints many lines (`ring … timeout`,
`Process information`, `GPU reset begin!`, …): each line is recorded and counted, but a
hook runs once per GPU and action within `debounce_s`. The same line again for the same
GPU within `debounce_s` (INCIDENTS §1: eight `GPU Recovery Failed: -19`) is no new event:
it is counted, and the event it repeats is revised to carry `count` (handed to
`on_revise(old, new)`; never published again, so the webhook goes once).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter, deque
from typing import Any, Callable, Iterable, Mapping, Protocol, runtime_checkable

from gpuguard.kernel.classify import GpuNameForBdf, to_event
from gpuguard.kernel.config import DEFAULT_POLICY
from gpuguard.kernel.kmsg import KmsgReader, KmsgRecord
from gpuguard.kernel.rules import Rules
from gpuguard.kernel.udev import DeviceEvent, UdevMonitor
from gpuguard.state.events import Event
from gpuguard.state.gpus import GpuStates

log = logging.getLogger(__name__)

# Conditions that end when the GPU shows up again (a udev add or bind event).
_CLEARED_BY_APPEARANCE = ("device_lost", "gpu_lost", "gpu_reset_failed", "pcie_link_down")


@runtime_checkable
class ActionHook(Protocol):
    """What the router calls. Any method may be missing; any may return an awaitable.
    `bdf` of on_gpu_fatal is None when the kernel named no device (`amdgpu: sq_intr: …`
    is printed without one): the watchdog decides what "this GPU" means then."""

    def on_alert(self, event: Event) -> object: ...
    def on_gpu_lost(self, bdf: str) -> object: ...
    def on_gpu_reset_ok(self, bdf: str) -> object: ...
    def on_gpu_fatal(self, bdf: str | None, kind: str) -> object: ...
    def on_gpu_appeared(self, bdf: str) -> object: ...


class KernelEventRouter:
    def __init__(
        self,
        rules: Rules,
        gpu_name_for_bdf: GpuNameForBdf | None = None,
        hooks: object | None = None,
        policy: Mapping[str, Iterable[str]] | None = None,
        *,
        max_events: int = 1000,
        debounce_s: float = 30.0,
        recover_settle_s: float = 2.0,
        on_event: Callable[[Event], object] | None = None,
        on_revise: Callable[[Event, Event], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
        states: GpuStates | None = None,
    ) -> None:
        self.rules = rules
        self.gpu_name_for_bdf = gpu_name_for_bdf
        self.hooks = hooks
        self.policy = {k: tuple(v) for k, v in (policy if policy is not None else DEFAULT_POLICY).items()}
        self.debounce_s = debounce_s
        self.recover_settle_s = recover_settle_s
        self.on_event = on_event
        self.on_revise = on_revise
        # (kind, bdf, gpu, text) -> [first seen (clock), the event that stands for them]
        self._repeats: dict[tuple, list] = {}
        self.clock = clock
        self.events: deque[Event] = deque(maxlen=max_events)
        self.states = states if states is not None else GpuStates()
        self.records_seen = 0
        self.hook_errors = 0
        self._last_action: dict[tuple[str | None, str], float] = {}
        self._recover_timers: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    # ── inputs ──────────────────────────────────────────────────────────────────
    def handle_record(self, record: KmsgRecord) -> Event | None:
        """Classify one kmsg record; record, count and act on it. None if benign."""
        self.records_seen += 1
        match = self.rules.classify(record.text)
        if match is None:
            return None
        event = to_event(record, match, self.gpu_name_for_bdf)
        if self._seen_elsewhere(event):
            return None  # NVML's event set reported this Xid first
        self._emit(event, match.clears)
        return event

    def handle_lost(self, lost: int, reader: KmsgReader) -> Event:
        """Records the reader never saw (overwritten in the ring): a hang or AER line among
        them was never classified, so say so with the count (also on /metrics)."""
        event = Event(kind="kernel_log_lost", severity="warning", source="kernel",
                      message=f"{lost} kernel log records lost before gpuguard read them: overwritten "
                              f"in the kernel's ring while gpuguard was paused or behind "
                              f"({reader.lost_records} lost since it started)",
                      fields={"lost": lost, "lost_total": reader.lost_records, "overruns": reader.overruns})
        self._record(event)
        return event

    def handle_device(self, dev: DeviceEvent) -> Event | None:
        """A udev event. A GPU's `remove` is `gpu_lost`; `add`/`bind` is an appearance
        (discovery, profile apply); everything else passes through to `on_device_change`."""
        if not dev.bdf or not self._is_gpu(dev):
            return None
        gpu = self.gpu_name_for_bdf(dev.bdf) if self.gpu_name_for_bdf else None
        fields = {"action": dev.action, "subsystem": dev.subsystem, "sys_path": dev.sys_path}
        if dev.action in ("remove", "unbind"):
            if (dev.bdf, "gpu_lost") in self.conditions or self.states.is_lost(dev.bdf):
                return None  # pci and drm both report one loss
            event = Event(kind="gpu_lost", severity="critical", source="udev",
                          message=f"GPU {dev.bdf} removed ({dev.subsystem} {dev.action})",
                          gpu=gpu, bdf=dev.bdf, fields={**fields, "condition": True, "route": "udev",
                                                        "engines": self.states.engines_on(dev.bdf)})
            self._emit(event, ())
            return event
        if dev.action in ("add", "bind"):
            was_lost = self.states.is_lost(dev.bdf)
            self.states.clear_conditions(dev.bdf, _CLEARED_BY_APPEARANCE)
            self.states.back(dev.bdf, f"udev {dev.action}")
            event = Event(kind="gpu_appeared", severity="info", source="udev",
                          message=f"GPU {dev.bdf} appeared ({dev.subsystem} {dev.action})"
                          + (", was lost" if was_lost else ""),
                          gpu=gpu, bdf=dev.bdf, fields=fields)
            self._record(event)
            if self._debounced(dev.bdf, "appeared"):
                self._call("on_gpu_appeared", dev.bdf)
            return event
        self._call("on_device_change", dev)
        return None

    def handle_external(self, event: Event, clears: Iterable[str] = ()) -> Event | None:
        """An event from another source of the same facts (NVML's event set):
        same kinds, same policy; dropped when the other source already reported it."""
        if self._seen_elsewhere(event):
            return None
        self._emit(event, clears)
        return event

    def _seen_elsewhere(self, event: Event, window_s: float = 30.0) -> bool:
        """One Xid (or one loss) seen by both the kernel log and NVML counts once."""
        if event.kind not in ("nvidia_xid", "device_lost") or event.bdf is None:
            return False
        for i, e in enumerate(reversed(self.events)):
            if i >= 100:
                break
            if (e.kind == event.kind and e.bdf == event.bdf and e.source != event.source
                    and abs(event.time - e.time) <= window_s
                    and (event.kind != "nvidia_xid" or e.fields.get("xid") == event.fields.get("xid"))):
                return True
        return False

    def _is_gpu(self, dev: DeviceEvent) -> bool:
        if self.gpu_name_for_bdf is not None and dev.bdf and self.gpu_name_for_bdf(dev.bdf):
            return True
        if dev.subsystem == "drm":
            return dev.is_drm_card
        # PCI class 0x03xxxx display controller, 0x12xxxx processing accelerator.
        return dev.pci_class is not None and (dev.pci_class >> 16) in (0x03, 0x12)

    # ── state ───────────────────────────────────────────────────────────────────
    def is_lost(self, bdf: str) -> bool:
        """A lost GPU is never written to until it reappears (DESIGN safety rule)."""
        return self.states.is_lost(bdf)

    @property
    def counts(self) -> Counter[tuple[str, str]]:
        return self.states.kernel_counts

    @property
    def conditions(self) -> dict[tuple[str, str], Event]:
        return self.states.conditions

    def events_since(self, since: float) -> list[Event]:
        return [e for e in self.events if e.time >= since]

    # ── core ────────────────────────────────────────────────────────────────────
    def _record(self, event: Event) -> None:
        self.events.append(event)
        if self.on_event is not None:
            try:
                result = self.on_event(event)
                self._spawn(result, "on_event")
            except Exception:  # noqa: BLE001
                self.hook_errors += 1
                log.exception("kernel event sink failed on %s", event.kind)  # pragma: no mutate

    def _repeated(self, event: Event) -> bool:
        """True when `event` repeats one recorded within debounce_s: that one is revised
        to count it instead of a new event being recorded."""
        key = (event.kind, event.bdf, event.gpu, event.message)
        now = self.clock()
        held = self._repeats.get(key)
        if held is None or now - held[0] >= self.debounce_s:
            if len(self._repeats) >= 1024:  # one entry per distinct line: forget old ones
                self._repeats = {k: v for k, v in self._repeats.items() if now - v[0] < self.debounce_s}
            self._repeats[key] = [now, event]
            return False
        old = held[1]
        held[1] = dataclasses.replace(old, fields={**old.fields, "count": old.fields.get("count", 1) + 1,
                                                   "last_seq": event.fields.get("seq"), "last_time": event.time})
        for i in range(len(self.events) - 1, -1, -1):
            if self.events[i] is old:
                self.events[i] = held[1]
                break
        if self.on_revise is not None:
            try:
                self.on_revise(old, held[1])
            except Exception:  # noqa: BLE001
                self.hook_errors += 1
                log.exception("kernel event sink failed revising %s", event.kind)  # pragma: no mutate
        return True

    def _emit(self, event: Event, clears: Iterable[str]) -> None:
        if event.alert_grade and event.kind in self.policy and "alert" not in self.policy[event.kind]:
            # `kernel.policy: {gpu_hang: []}` still sent webhooks; the notifier
            # skips events marked so (sinks/alert_gate.py)
            event = dataclasses.replace(event, fields={**event.fields, "alert": False})
        if not self._repeated(event):
            self._record(event)
        self.states.kernel_event(event, clears)
        bdf = event.bdf
        for action in self.policy.get(event.kind, ()):
            if action == "alert":
                if self._debounced(bdf, f"alert:{event.kind}"):
                    self._call("on_alert", event)
            elif action == "mark_lost":
                if bdf is None:
                    log.warning("%s names no GPU; cannot mark one lost: %s", event.kind, event.message)  # pragma: no mutate
                elif not self.states.is_lost(bdf):
                    self._cancel_recover(bdf)
                    # a udev remove is already a `gpu_lost` event: one alert per loss
                    self.states.mark_lost(bdf, f"{event.source}:{event.kind}", event.message,
                                          quiet=event.kind == "gpu_lost")
                    self._call("on_gpu_lost", bdf)
            elif action == "kill_engines":
                if self._debounced(bdf, "kill_engines"):
                    self._call("on_gpu_fatal", bdf, event.kind)
            elif action == "recover":
                if bdf is None:
                    log.warning("%s names no GPU; nothing to recover: %s", event.kind, event.message)  # pragma: no mutate
                else:
                    self._schedule_recover(bdf)

    def _debounced(self, bdf: str | None, action: str) -> bool:
        """True when the action may run now (not run for this GPU within debounce_s)."""
        now = self.clock()
        last = self._last_action.get((bdf, action))
        if last is not None and now - last < self.debounce_s:
            return False
        self._last_action[(bdf, action)] = now
        return True

    def _schedule_recover(self, bdf: str) -> None:
        # A reset prints several "ok" lines ("GPU reset succeeded, trying to resume",
        # "VRAM is lost…", "GPU reset(2) succeeded!"): recover once, after the last one,
        # when the card has finished resuming.
        self._cancel_recover(bdf)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or self.recover_settle_s <= 0:
            self.states.reset(bdf, "kernel: GPU reset succeeded")
            if self._debounced(bdf, "recover"):
                self._call("on_gpu_reset_ok", bdf)
            return

        def fire() -> None:
            self._recover_timers.pop(bdf, None)
            # the card is at stock settings (its profile pending again) and back if lost
            self.states.reset(bdf, "kernel: GPU reset succeeded")
            if not self.states.is_lost(bdf) and self._debounced(bdf, "recover"):
                self._call("on_gpu_reset_ok", bdf)

        self._recover_timers[bdf] = loop.call_later(self.recover_settle_s, fire)

    def _cancel_recover(self, bdf: str) -> None:
        timer = self._recover_timers.pop(bdf, None)
        if timer is not None:
            timer.cancel()

    def _call(self, name: str, *args: Any) -> None:
        method = getattr(self.hooks, name, None) if self.hooks is not None else None
        if method is None:
            return
        try:
            self._spawn(method(*args), name)
        except Exception:  # noqa: BLE001 - a failing hook must not stop event handling
            self.hook_errors += 1
            log.exception("kernel event hook %s%r failed", name, args)  # pragma: no mutate

    def _spawn(self, result: object, name: str) -> None:
        if not asyncio.iscoroutine(result) and not isinstance(result, asyncio.Future):
            return
        task = asyncio.ensure_future(result)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                self.hook_errors += 1
                log.error("kernel event hook %s failed: %r", name, t.exception())  # pragma: no mutate

        task.add_done_callback(done)

    # ── running ─────────────────────────────────────────────────────────────────
    async def run_kmsg(self, reader: KmsgReader) -> None:
        reader.on_lost = lambda lost: self.handle_lost(lost, reader)
        async for record in reader.records():
            try:
                self.handle_record(record)
            except Exception:  # noqa: BLE001 - one bad record must not stop the reader
                log.exception("kernel record %d could not be handled", record.seq)  # pragma: no mutate

    async def run_udev(self, monitor: UdevMonitor) -> None:
        async for dev in monitor.events():
            try:
                self.handle_device(dev)
            except Exception:  # noqa: BLE001
                log.exception("udev event %s %s could not be handled", dev.action, dev.sys_path)  # pragma: no mutate
