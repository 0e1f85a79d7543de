"""Replay of a capture made by `python -m gpuguard.hw.nvml_capture` on a real host.

`NvmlTimeline` answers like the `pynvml` module: discovery calls from the capture's
discovery record, poll calls from the current sample (`select(i)` / `advance()` walks the
idle → load → after timeline), event waits in recorded order (then, like the driver, a wait blocks for its timeout
unless an event arrives: `deliver()` hands one in, as a card raising an Xid would). Errors come back as
exception classes with NVML's own names (`NVMLError_NotSupported`), so the reader's
error handling is the code that ran on the real card. A call the capture never made is
`NVMLError_FunctionNotFound`: the replay never invents an answer.

With `latency=True` every answer takes the wall time the real call took (busy-wait),
which is what bench/nvml_poll_cost.py needs to weigh the driver against the Python.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any


class _Obj:
    def __init__(self, d: dict) -> None:
        self.__dict__.update(d)

    def __repr__(self) -> str:
        return f"Struct({self.__dict__})"


class _Handle:
    """Stands in for an NVML device/event-set pointer."""

    def __init__(self, index: int | None = None) -> None:
        self.index = index


def _decode(r: Any) -> Any:
    if isinstance(r, dict) and "__struct__" in r:
        return _Obj({k: _decode(v) for k, v in r["__struct__"].items()})
    if isinstance(r, dict) and "__handle__" in r:
        return _Handle()
    if isinstance(r, list):
        return [_decode(x) for x in r]
    return r


def _key(call: str, args: list | tuple) -> tuple:
    out = []
    for a in args:
        if isinstance(a, (int, str)):
            out.append(a)
        elif isinstance(a, (list, tuple)) and all(isinstance(x, int) for x in a):
            out.append(tuple(a))
        else:
            out.append("h")
    return (call, tuple(out))


def _index(calls: list[dict]) -> dict[tuple, dict]:
    out: dict[tuple, dict] = {}
    for c in calls:
        out.setdefault(_key(c["call"], c["args"]), c)
    return out


class NvmlTimeline:
    def __init__(self, capture: dict, sample: int = 0, latency: bool = False) -> None:
        self.capture = capture
        self.meta = capture.get("meta", {})
        self.samples = capture["samples"]
        self._discovery = _index(capture["discovery"])
        self._sample_index = [_index(s["calls"]) for s in self.samples]
        self._events = list(capture.get("events", []))
        self._event_pos = 0
        self._arrived = threading.Condition()
        self.latency = latency
        self._errors: dict[str, type] = {}
        self.sample = 0
        self.select(sample)

    @classmethod
    def load(cls, path: str, sample: int = 0, latency: bool = False) -> "NvmlTimeline":
        with open(path) as f:
            return cls(json.load(f), sample=sample, latency=latency)

    # -- timeline ---------------------------------------------------------------------
    def select(self, i: int) -> None:
        self.sample = i % len(self.samples)

    def advance(self) -> bool:
        """Next sample; False at the end (stays on the last)."""
        if self.sample + 1 >= len(self.samples):
            return False
        self.sample += 1
        return True

    @property
    def phase(self) -> str:
        return self.samples[self.sample]["phase"]

    def indices(self, phase: str) -> list[int]:
        return [i for i, s in enumerate(self.samples) if s["phase"] == phase]

    # -- the pynvml surface -----------------------------------------------------------
    def error(self, name: str) -> type:
        if name not in self._errors:
            self._errors[name] = type(name, (Exception,), {})
        return self._errors[name]

    def __getattr__(self, attr: str) -> Any:
        if not attr.startswith("nvml"):
            raise AttributeError(attr)

        def call(*args: Any) -> Any:
            if attr.startswith("nvmlEventSetWait"):
                timeout_ms = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
                return self._answer(self._next_event(timeout_ms / 1000.0), attr)
            key = _key(attr, args)
            ans = self._sample_index[self.sample].get(key) or self._discovery.get(key)
            if ans is None:
                raise self.error("NVMLError_FunctionNotFound")(f"{attr}{key[1]} is not in the capture")
            return self._answer(ans, attr)

        return call

    def deliver(self, answer: dict) -> None:
        """An event the card raises now, shaped as a recorded one (`{"result": ...}`)."""
        with self._arrived:
            self._events.append(answer)
            self._arrived.notify_all()

    def _next_event(self, timeout: float = 0.0) -> dict | None:
        with self._arrived:
            # the recorded events at once; past them, wait as nvmlEventSetWait does
            self._arrived.wait_for(lambda: self._event_pos < len(self._events), timeout)
            if self._event_pos >= len(self._events):
                return None
            e = self._events[self._event_pos]
            self._event_pos += 1
            return e

    def _answer(self, ans: dict | None, attr: str) -> Any:
        if ans is None:
            raise self.error("NVMLError_Timeout")("Timeout (the capture's events are used up)")
        if self.latency and "ns" in ans:
            end = time.perf_counter_ns() + int(ans["ns"])
            while time.perf_counter_ns() < end:
                pass
        if "error" in ans:
            raise self.error(ans["error"])(ans.get("message", ""))
        return _decode(ans["result"])

    def nvmlInit(self) -> None:
        return None

    def nvmlShutdown(self) -> None:
        return None
