"""Incidents replayed into a flight recorder: the rows gpuguard would have written on the
hosts of INCIDENTS §1 and §2, through the recorder's own code (FlightRecorder.record with
GPU snapshots, engine snapshots and events), with kernel lines classified by the real
rules. Test equipment for `gpuguard report` and the page, and a history for benchmarks.

The caller hands in the recorder to write through (`open_recorder`, in practice
sinks/recorder.FlightRecorder): the equipment describes what happened and never imports
the sink that keeps it. Each replay returns the moment the report should be about
(`Replay.focus`) and the recorder path; times are wall-clock seconds starting at `t0`.
"""
from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol

from gpuguard.engines.snapshot import EngineSnapshot
from gpuguard.kernel.rules import Rules
from gpuguard.state.events import Event
from gpuguard.state.hub import HostSnapshot
from gpuguard.state.snapshot import GpuSnapshot

STEP = 0.5  # the demo's poll interval


class Recorder(Protocol):
    """What a replay writes through (sinks/recorder.FlightRecorder's own methods)."""

    def record(self, snap: HostSnapshot | None = None, events: Iterable[Event] = (),
               engines: Mapping[str, Any] | None = None) -> Future: ...
    def sample_rows(self, snap: HostSnapshot) -> list[tuple]: ...
    def event_rows(self, events: Iterable[Event]) -> list[tuple]: ...
    def close(self) -> None: ...


OpenRecorder = Callable[..., Recorder]  # (path, keep_seconds=...) -> a recorder on that file


@dataclass(frozen=True)
class Replay:
    path: str
    focus: float  # when the thing happened
    event_kind: str | None  # the alert-grade event at `focus`, if the kernel said anything
    gpus: tuple[str, ...]


def gpu_snapshot(name: str, bdf: str, model: str, t: float, *, up: bool = True, power: float | None = None,
         cap: float = 355.0, edge: float | None = None, junction: float | None = None, mem: float | None = None,
         sclk: float | None = None, mclk: float | None = None, fan: float | None = None, busy: float | None = None,
         vram: int | None = None) -> GpuSnapshot:
    return GpuSnapshot(
        name=name, bdf=bdf, vendor="1002", device_id="744c" if "XTX" in model else "7551", driver="amdgpu",
        model=model, card=None, up=up, time=t, power_watts=power, power_cap_watts=cap if up else None,
        temperatures={k: v for k, v in (("edge", edge), ("junction", junction), ("mem", mem)) if v is not None},
        clocks_hz={k: v for k, v in (("sclk", sclk), ("mclk", mclk)) if v is not None},
        fan_rpm=fan, busy_ratio=busy, vram_used_bytes=vram,
        errors={} if up else {"power_watts": "read power1_average: ENODEV (No such device)"},
    )


def _engine(name: str, t: float, state: str, tokens: float, tps: float | None, no_progress: float,
            running: float) -> EngineSnapshot:
    return EngineSnapshot(
        name=name, kind="sglang", state=state, pid=4242, requests_running=running, requests_waiting=0.0,
        generated_tokens_total=tokens, heartbeat=None, tokens_per_second=tps, no_progress_seconds=no_progress,
        decode_gap_seconds=None, stalled=state == "stalled", cpu_percent=200.0, last_action=None,
        time_to_ready_seconds=None, polled_at=t,
    )


def _kernel_event(rules: Rules, text: str, t: float, names: dict[str, str]) -> Event:
    m = rules.classify(text)
    assert m is not None, f"no rule matches {text!r}"
    return Event(kind=m.kind, severity=m.severity, source="kernel", message=text, gpu=names.get(m.bdf or ""),
                 bdf=m.bdf, time=t, fields={"rule": m.rule, "condition": m.condition})


def incident_1(path: str, t0: float, open_recorder: OpenRecorder) -> Replay:
    """§1: two 7900 XTX behind a switch, SGLang TP=2. 120 s of steady decoding at
    ~272 W, then a request hangs (tokens stop, power stays up, CPU pinned), the watchdog
    alerts after 10 s, and 60 s into the stall the kernel logs sq_intr, `device lost from
    bus` and eight `GPU Recovery Failed: -19`; both cards stop answering."""
    rec = open_recorder(path, keep_seconds=10 * 86400)
    rules = Rules.load()
    cards = (("xtx-0", "0000:aa:00.0", 272.0, 56.0, 799.0), ("xtx-1", "0000:b0:00.0", 271.0, 54.0, 642.0))
    names = {bdf: name for name, bdf, *_ in cards}
    stall_at, sq_at, lost_at, end = 120.0, 180.0, 185.0, 240.0
    tokens = 0.0
    futures = []
    t = 0.0
    while t <= end:
        now = t0 + t
        up = t < lost_at
        snaps = []
        for i, (name, bdf, watts, temp, fan) in enumerate(cards):
            wob = math.sin(t / 3.0 + i)
            if up:
                snaps.append(gpu_snapshot(name, bdf, "Radeon RX 7900 XTX", now, power=round(watts + 4 * wob, 1),
                                  edge=temp + wob, junction=temp + 18 + wob, mem=temp + 10, sclk=2.4e9 + 3e7 * wob,
                                  mclk=1.249e9, fan=fan + 10 * wob, busy=0.99, vram=22 * 2**30))
            else:
                snaps.append(gpu_snapshot(name, bdf, "Radeon RX 7900 XTX", now, up=False))
        decoding = t < stall_at
        tps = 41.0 + 2 * math.sin(t / 5.0) if decoding else 0.0
        if decoding:
            tokens += tps * STEP
        state = "busy" if decoding else "stalled" if t >= stall_at + 10 else "busy"
        eng = {"sglang": _engine("sglang", now, state, tokens, tps, 0.0 if decoding else t - stall_at, 1.0)}
        futures.append(rec.record(HostSnapshot(now, tuple(snaps)), engines=eng))
        t = round(t + STEP, 3)
    events = [
        Event(kind="engine_stalled", severity="alert", source="engines", engine="sglang",
              message="engine sglang stalled: tokens not moving while a request runs (no progress 10.0 s)",
              time=t0 + stall_at + 10, fields={"reason": "no_tokens"}),
        _kernel_event(rules, "amdgpu: sq_intr: error, se 1, cu 6, simd 0, wave 17", t0 + sq_at, names),
        *[_kernel_event(rules, f"amdgpu {bdf}: amdgpu: device lost from bus!", t0 + lost_at + i * 0.1, names)
          for i, (_, bdf, *_x) in enumerate(cards)],
        *[_kernel_event(rules, f"amdgpu {cards[i % 2][1]}: amdgpu: GPU Recovery Failed: -19", t0 + lost_at + 1 + i * 0.5,
                        names) for i in range(8)],
    ]
    futures.append(rec.record(events=events))
    for f in futures:
        f.result()
    rec.close()
    return Replay(path, t0 + lost_at, "device_lost", tuple(n for n, *_ in cards))


def incident_2(path: str, t0: float, open_recorder: OpenRecorder) -> Replay:
    """§2: two R9700 at a 280 W cap on one 1300 W PSU. r9700-a decodes alone for 60 s
    (fine), then r9700-b ramps up too; 47 s later the recording stops — a hard power-off
    with no kernel line at all (PSU protection). The report is about the last sample."""
    rec = open_recorder(path, keep_seconds=10 * 86400)
    cards = (("r9700-a", "0000:05:00.0"), ("r9700-b", "0000:08:00.0"))
    both_at, trip_at = 60.0, 107.0
    futures = []
    t = 0.0
    last = t0
    while t <= trip_at:
        now = last = t0 + t
        snaps = []
        for i, (name, bdf) in enumerate(cards):
            if i == 0 or t >= both_at:
                ramp = 1.0 if i == 0 else min(1.0, (t - both_at) / 5.0)
                # INCIDENTS §2: averages held near 250-263 W while transients tripped the PSU
                climb = (t - both_at) / (trip_at - both_at) if t >= both_at else 0.0
                power = 25 + ramp * (225 + 38 * climb + 6 * math.sin(t + i))
                snaps.append(gpu_snapshot(name, bdf, "Radeon AI PRO R9700", now, power=round(power, 1), cap=280.0,
                                  edge=45 + 20 * ramp, junction=55 + 30 * ramp, mem=50 + 12 * ramp,
                                  sclk=(0.6 + 2.3 * ramp) * 1e9, mclk=1.258e9, fan=900 + 1100 * ramp, busy=ramp,
                                  vram=28 * 2**30))
            else:
                snaps.append(gpu_snapshot(name, bdf, "Radeon AI PRO R9700", now, power=25.0, cap=280.0, edge=35.0,
                                  junction=36.0, mem=40.0, sclk=1.6e7, mclk=9.6e7, fan=0.0, busy=0.0, vram=2**28))
        futures.append(rec.record(HostSnapshot(now, tuple(snaps))))
        t = round(t + STEP, 3)
    for f in futures:
        f.result()
    rec.close()
    return Replay(path, last, None, tuple(n for n, _ in cards))


def history(path: str, t0: float, seconds: float, open_recorder: OpenRecorder, gpus: int = 8, step: float = STEP,
            events_every: float = 60.0) -> Replay:
    """A long, unremarkable history (bench/: page load with 8 GPUs and an hour behind).
    Rows are made by the recorder's own row functions and written in large transactions
    (one fsync per poll, as the daemon does, would take minutes for an hour)."""
    import sqlite3

    rec = open_recorder(path)
    rec.close()  # the schema
    names = [f"gpu{i}" for i in range(gpus)]
    samples: list[tuple] = []
    events: list[Event] = []
    t = 0.0
    n = 0
    while t <= seconds:
        now = t0 + t
        snaps = tuple(
            gpu_snapshot(name, f"0000:{0x10 + i:02x}:00.0", "Radeon AI PRO R9700", now,
                 power=round(150 + 100 * math.sin(t / 60 + i), 1), cap=280.0, edge=60 + 10 * math.sin(t / 90 + i),
                 junction=75 + 10 * math.sin(t / 90 + i), mem=70.0, sclk=2.5e9, mclk=1.258e9, fan=1500.0,
                 busy=0.5 + 0.5 * math.sin(t / 60 + i), vram=20 * 2**30)
            for i, name in enumerate(names))
        samples += rec.sample_rows(HostSnapshot(now, snaps))
        if events_every and n % max(1, int(events_every / step)) == 0:
            events.append(Event(kind="note", severity="warning" if n % 7 else "alert", source="bench",
                                message=f"tick {n}", gpu=names[n % gpus], time=now))
        t = round(t + step, 3)
        n += 1
    with sqlite3.connect(path) as db:
        db.executemany("INSERT INTO samples VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", samples)
        db.executemany("INSERT INTO events VALUES (?,?,?,?,?,?,?,?,?)", rec.event_rows(events))
    return Replay(path, t0 + seconds, None, tuple(names))
