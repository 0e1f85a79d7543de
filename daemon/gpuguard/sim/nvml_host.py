"""Test equipment: `gpuguard run` on a recorded NVIDIA card. The daemon's NVML source is the
replay of a real capture (hw/nvml_replay.py, e.g. tests/fixtures/h200/nvml-capture.json)
held on one recorded sample, and a control channel injects faults into the replayed
answers, in NVML's own shapes, the way they would come from a card that has them:

    python -m gpuguard.sim.nvml_host --capture FILE --control SOCK [--sample-phase load] \\
        -- run --config gpuguard.yaml

Control ops (JSON lines, sim/control.py's protocol):
  throttle(reasons)     the clocks-event-reason mask the card reports: the recorded bits
                        plus these (names of nvml_calls.THROTTLE_REASONS)
  field(name, value)    one nvmlFieldValue_t (nvml_calls.FIELDS name) answers `value`
  xid(xid)              the card raises an Xid on its event set (shaped as a recorded event)
  stop_poller()         cancels the daemon's GPU poll task, as a gpuguard bug would: the
                        HTTP server goes on answering. No hardware fault can do that
                        (every read of the poll cycle is bounded, poller.py), so it is
                        the only way to show GpuguardNotPolling.

Never a production path: the daemon itself has no way to fake NVML; this module builds
the Daemon with the replay as its source, like tests/nvml/test_nvml_daemon.py does.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
from typing import Any

from gpuguard.hw import nvml_calls as C
from gpuguard.hw.nvml_replay import NvmlTimeline

REASON_CALLS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")


def registering_critical_types(cap: dict) -> dict:
    """The capture registered every supported event type; gpuguard registers the critical
    subset. NVML answers a subset as it answered the whole (success, no data)."""
    real = next((c for c in cap["discovery"] if c["call"] == "nvmlDeviceRegisterEvents"), None)
    if real is not None:
        sub = copy.deepcopy(real)
        sub["args"][1] = real["args"][1] & C.EVENTS_WANTED
        cap["discovery"].append(sub)
    return cap


class NvmlFaults:
    """Changes to the replayed answers, applied to every recorded sample (so the one the
    daemon reads is changed whichever it is)."""

    def __init__(self, capture: dict, timeline: NvmlTimeline) -> None:
        self.capture = capture
        self.timeline = timeline
        self.daemon: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        real = next((e for e in capture.get("events", []) if "result" in e), None)
        self._event_shape = copy.deepcopy(real)

    def _calls(self, name: str):
        for s in self.capture["samples"]:
            for c in s["calls"]:
                if c["call"] == name and "result" in c:
                    yield c

    def throttle(self, reasons: list[str]) -> dict:
        bits = {label: bit for bit, label in C.THROTTLE_REASONS.items()}
        unknown = [r for r in reasons if r not in bits]
        if unknown:
            raise ValueError(f"unknown throttle reason(s) {unknown}; known: {', '.join(bits)}")
        add = sum(bits[r] for r in reasons)
        masks = {}
        for name in REASON_CALLS:
            for c in self._calls(name):
                c.setdefault("recorded", c["result"])
                c["result"] = int(c["recorded"]) | add
                masks[name] = c["result"]
        return masks

    def field(self, name: str, value: int) -> int:
        if name not in C.FIELDS:
            raise ValueError(f"unknown NVML field {name!r}; known: {', '.join(C.FIELDS)}")
        n = 0
        for c in self._calls("nvmlDeviceGetFieldValues"):
            for fv in c["result"]:
                st = fv["__struct__"]
                if st["fieldId"] == C.FIELDS[name]:
                    if st["nvmlReturn"] != 0:
                        raise ValueError(f"field {name} is not supported on the recorded card")
                    for member in st["value"]["__struct__"]:
                        st["value"]["__struct__"][member] = float(value) if member == "dVal" else int(value)
                    n += 1
        if not n:
            raise ValueError(f"field {name} was not read in the capture")
        return n

    def xid(self, xid: int) -> None:
        if self._event_shape is None:
            raise ValueError("the capture holds no delivered event to shape an Xid on")
        e = copy.deepcopy(self._event_shape)
        e["result"]["__struct__"].update(eventType=C.EVENT_XID, eventData=int(xid))
        self.timeline.deliver(e)

    def stop_poller(self) -> bool:
        if self.daemon is None or self.loop is None:
            raise RuntimeError("the daemon is not serving yet")
        task = next((t for t in self.daemon.tasks if t.get_name() == "poller"), None)
        if task is None:
            raise RuntimeError("the daemon has no poller task")
        self.loop.call_soon_threadsafe(task.cancel)
        return True

    def ops(self) -> dict:
        return {"throttle": self.throttle, "field": self.field, "xid": self.xid, "stop_poller": self.stop_poller}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m gpuguard.sim.nvml_host --capture FILE --control SOCK -- run --config FILE",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m gpuguard.sim.nvml_host")
    p.add_argument("--capture", required=True, help="a capture of python -m gpuguard.hw.nvml_capture")
    p.add_argument("--control", required=True, help="UNIX socket of the fault control channel")
    p.add_argument("--sample-phase", default="load", help="recorded phase whose first sample is held (idle|load|after)")
    args = p.parse_args(argv[:cut])
    from gpuguard.cli.run import exit_now_if_stuck, register, run_bounded
    from gpuguard.config import ConfigError, load_config
    from gpuguard.daemon import Daemon
    from gpuguard.hw.nvml import NvmlSource
    from gpuguard.logsetup import setup_logging

    from .control import ControlServer

    top = argparse.ArgumentParser(prog="gpuguard")
    register(top.add_subparsers(dest="cmd", required=True))
    run_args = top.parse_args(argv[cut + 1:])
    try:
        with open(args.capture) as f:
            cap = registering_critical_types(json.load(f))
    except (OSError, json.JSONDecodeError) as e:
        print(f"nvml_host: cannot read the capture {args.capture}: {e}", file=sys.stderr)
        return 2
    tl = NvmlTimeline(cap)
    held = tl.indices(args.sample_phase)
    if not held:
        print(f"nvml_host: the capture {args.capture} has no {args.sample_phase!r} sample", file=sys.stderr)
        return 2
    tl.select(held[len(held) // 2])  # mid-phase: the card settled in it
    try:
        config = load_config(run_args.config)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 2
    setup_logging(config.logging.level)
    faults = NvmlFaults(cap, tl)
    daemon = Daemon(config, config_path=run_args.config, sysfs_root=run_args.sysfs_root, sources=[NvmlSource(tl)])
    faults.daemon = daemon

    def serving() -> None:
        faults.loop = asyncio.get_running_loop()

    daemon.on_serving.append(serving)
    control = ControlServer(None, args.control, extra=faults.ops()).start()  # type: ignore[arg-type]
    try:
        code = run_bounded(daemon.run())
    except RuntimeError as e:
        print(f"gpuguard: {e}", file=sys.stderr)
        code = 1
    finally:
        control.stop()
    exit_now_if_stuck(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
