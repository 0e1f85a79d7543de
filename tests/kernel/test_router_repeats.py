"""One incident's identical kernel lines are one event with their count (INCIDENTS §1:
`device lost from bus`, then eight `GPU Recovery Failed: -19`, were eight critical
events): every line still counted on /metrics, the webhook sent once, the recording and
the event list hold the one event with `count: 8`."""
from __future__ import annotations

import sqlite3
import time

from gpuguard.kernel.kmsg import parse_record
from gpuguard.kernel.router import KernelEventRouter
from gpuguard.kernel.rules import Rules
from gpuguard.sinks.alert_gate import AlertGate
from gpuguard.sinks.recorder import FlightRecorder
from gpuguard.state.hub import Hub


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _line(labelled, needle: str) -> dict:
    return next(l for l in labelled if needle in l["text"])


def test_eight_recovery_failed_lines_are_one_event_with_their_count(labelled, tmp_path):
    failed, lost = _line(labelled, "GPU Recovery Failed: -19"), _line(labelled, "device lost from bus")
    bdf = failed["bdf"]
    hub, clock = Hub(), Clock()
    router = KernelEventRouter(Rules.load(), gpu_name_for_bdf={bdf: "xtx-0"}.get, on_event=hub.publish,
                               on_revise=hub.revise, states=hub.gpus, clock=clock)
    gate, sent = AlertGate(), []
    hub.on_event(lambda e: sent.append(a) if (a := gate.admit(e)) is not None else None)
    rec = FlightRecorder(str(tmp_path / "flight.sqlite"))
    hub.on_event(rec.add_event)
    hub.on_revise(rec.revise_event)
    seq = iter(range(500, 600))

    def feed(text: str, dev: str) -> None:
        # a real record as /dev/kmsg hands it out, with the DEVICE= key dev_err sets
        usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
        router.handle_record(parse_record(f"3,{next(seq)},{usec},-;{text}\n SUBSYSTEM=pci\n DEVICE=+pci:{dev}\n".encode()))

    feed(lost["text"].replace(lost["bdf"], bdf), bdf)
    for _ in range(4):
        feed(failed["text"], bdf)
    rec.record().result()  # a poll cycle commits the first lines; four more follow it
    for _ in range(4):
        clock.now += 1.0
        feed(failed["text"], bdf)
    rec.flush()

    kinds = [e.kind for e in hub.events]
    assert kinds == ["device_lost", "gpu_reset_failed"], kinds
    (ev,) = [e for e in hub.events if e.kind == "gpu_reset_failed"]
    assert ev.fields["count"] == 8 and ev.severity == "critical" and ev.gpu == "xtx-0"
    assert [e.fields.get("count") for e in router.events] == [None, 8]
    assert hub.gpus.kernel_counts[("xtx-0", "gpu_reset_failed")] == 8  # the metric counts every line
    assert [e.kind for e in sent] == ["device_lost", "gpu_reset_failed"]  # the webhook once
    db = sqlite3.connect(f"file:{rec.path}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT kind, json_extract(fields, '$.count') FROM events ORDER BY t").fetchall()
    finally:
        db.close()
    assert rows == [("device_lost", None), ("gpu_reset_failed", 8)]

    # the same line after the window is news again; another GPU's is its own event
    clock.now += router.debounce_s + 1
    feed(failed["text"], bdf)
    other = "0000:bb:00.0"
    feed(failed["text"].replace(bdf, other), other)
    assert [e.fields.get("count") for e in hub.events if e.kind == "gpu_reset_failed"] == [8, None, None]
    rec.close()
