"""`gpuguard record`: the flight recorder, readable without sqlite3.

    gpuguard record [--since 10m] [--gpu NAME] [--events] [--json|--csv] [--db FILE]

Prints the GPU samples (one row per GPU and poll) and the events of the window, oldest
first. `--db` reads any `flight.sqlite`, a copy from another host included (opened
read-only). Default file: `recorder.path` of `-c CONFIG`, else
/var/lib/gpuguard/flight.sqlite.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

DEFAULT_DB = "/var/lib/gpuguard/flight.sqlite"


def add_db_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=None, metavar="FILE",
                   help=f"flight recorder file (default: recorder.path of --config, else {DEFAULT_DB})")
    p.add_argument("--config", "-c", metavar="FILE", default=None, help="gpuguard.yaml to take recorder.path from")


def db_path(args: argparse.Namespace) -> str:
    if args.db:
        return args.db
    if args.config:
        from gpuguard.config import load_config

        return load_config(args.config).recorder.path
    return os.environ.get("GPUGUARD_DB", DEFAULT_DB)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("record", help="print the flight recorder (samples and events)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--since", default="10m", help="window: an age (90s, 10m, 2h) or a time (default 10m)")
    p.add_argument("--until", default=None, help="end of the window (default: now)")
    p.add_argument("--gpu", default=None, help="one GPU (configured name or PCI address)")
    p.add_argument("--events", action="store_true", help="only the events")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON document {samples, engines, events}")
    fmt.add_argument("--csv", action="store_true", help="samples as CSV (events with --events)")
    add_db_options(p)
    p.set_defaults(func=cmd_record)


def _fmt(v, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def cmd_record(args: argparse.Namespace) -> int:
    from gpuguard.config import ConfigError
    from gpuguard.report.history import GPU_SERIES, FlightLog, HistoryError, parse_time

    try:
        start = parse_time(args.since)
        end = parse_time(args.until) if args.until else time.time()
    except ValueError as e:
        print(f"gpuguard record: {e}", file=sys.stderr)
        return 2
    try:
        flight = FlightLog.open(db_path(args))
        samples = [] if args.events else flight.samples(start, end, args.gpu)
        engines = [] if args.events else flight.engine_samples(start, end)
        events = flight.events(start, end, args.gpu)
    except (HistoryError, ConfigError) as e:
        print(f"gpuguard record: {e}", file=sys.stderr)
        return 1
    out = sys.stdout
    if args.json:
        json.dump({"db": flight.path, "start": start, "end": end, "samples": samples, "engines": engines,
                   "events": events}, out, indent=1)
        out.write("\n")
        return 0
    if args.csv:
        if args.events:
            w = csv.writer(out)
            w.writerow(["id", "time", "kind", "severity", "source", "gpu", "bdf", "engine", "message"])
            for e in events:
                w.writerow([e[k] for k in ("id", "time", "kind", "severity", "source", "gpu", "bdf", "engine", "message")])
        else:
            w = csv.writer(out)
            w.writerow(["time", "gpu", "bdf", *GPU_SERIES])
            for s in samples:
                w.writerow([s["t"], s["gpu"], s["bdf"], *("" if s[k] is None else s[k] for k in GPU_SERIES)])
        return 0
    if not samples and not events:
        print(f"no samples or events in {flight.path} between {_clock(start)} and {_clock(end)}")
        return 0
    if samples:
        print(f"{'time':<12} {'gpu':<12} {'up':>2} {'power':>7} {'cap':>5} {'edge':>5} {'junct':>5} {'mem':>5} "
              f"{'sclk':>5} {'mclk':>5} {'fan':>5} {'busy':>4} {'vram':>7}")
        print(f"{'':<12} {'':<12} {'':>2} {'W':>7} {'W':>5} {'°C':>5} {'°C':>5} {'°C':>5} "
              f"{'MHz':>5} {'MHz':>5} {'rpm':>5} {'%':>4} {'GiB':>7}")
        for s in samples:
            print(f"{_clock(s['t']):<12} {s['gpu']:<12} {'y' if s['up'] else 'n':>2} {_fmt(s['power_w'], digits=1):>7} "
                  f"{_fmt(s['cap_w']):>5} {_fmt(s['edge_c']):>5} {_fmt(s['junction_c']):>5} {_fmt(s['mem_c']):>5} "
                  f"{_fmt(s['sclk_hz'], 1e-6):>5} {_fmt(s['mclk_hz'], 1e-6):>5} {_fmt(s['fan_rpm']):>5} "
                  f"{_fmt(s['busy'], 100):>4} {_fmt(s['vram_used'], 2**-30, 2):>7}")
    if events:
        if samples:
            print()
        print("events:")
        for e in events:
            where = " ".join(x for x in (e["gpu"], e["engine"]) if x)
            print(f"  #{e['id']:<5} {_clock(e['time'])} {e['severity']:<8} {e['kind']:<20} {where:<12} {e['message']}")
    return 0


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 10) % 10}"
