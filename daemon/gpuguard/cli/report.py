"""`gpuguard report`: an incident report from the flight recorder.

    gpuguard report [--event ID | --at TIME] [--before 2m] [--after 1m] [-o FILE] [--db FILE]
    gpuguard report --incident DIR|NAME [-o FILE] [--config FILE]

Writes FILE (one self-contained HTML file: charts inline, no network) and FILE with
`.png`: every GPU's power, temperatures, clocks and fan, engine progress, and the kernel
lines and gpuguard events on one time axis around the moment. Without --event/--at: the
newest alert-grade event, else the last sample (after a PSU trip: the moment the
recording stopped). Event ids: `gpuguard record --events`. Works on a copied
flight.sqlite (`--db`).

With --incident: the engine incident bundle (a folder, or a bundle's name under
state_dir/incidents of --config) drawn the same way from its own files: the stall
decision's evidence, every engine process's state, wchan and stacks, py-spy's Python
stacks, the engine's readings and the GPU telemetry of those minutes, the kernel lines.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from gpuguard.cli.record import add_db_options, db_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="incident report (HTML + PNG) from the flight recorder", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--event", type=int, default=None, metavar="ID", help="the event (id from `gpuguard record --events`)")
    which.add_argument("--at", default=None, metavar="TIME", help="a moment: unix time, ISO time, or an age (5m)")
    which.add_argument("--incident", default=None, metavar="DIR|NAME",
                       help="an engine incident bundle: its folder, or its name under state_dir/incidents")
    p.add_argument("--before", default="2m", help="how much before the moment (default 2m)")
    p.add_argument("--after", default="1m", help="how much after it (default 1m)")
    p.add_argument("--gpu", default=None, help="only this GPU")
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="HTML file to write (default gpuguard-report-<time>.html); the PNG goes next to it")
    add_db_options(p)
    p.set_defaults(func=cmd_report)


def incident_dir(spec: str, config: str | None) -> str:
    """A folder as given, else a bundle name under the configured state_dir/incidents."""
    if os.path.isdir(spec) or os.sep in spec:
        return spec
    from gpuguard.config import load_config

    return os.path.join(load_config(config).state_dir, "incidents", spec)


def write_report(rep, out: str, png_path: str) -> bool:
    """The HTML and its PNG beside it; False (said on stderr) when either cannot be written."""
    try:
        with open(out, "w", encoding="utf-8") as f:
            f.write(rep.html)
        with open(png_path, "wb") as f:
            f.write(rep.png)
    except OSError as e:
        print(f"gpuguard report: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
        return False
    return True


def cmd_incident(args: argparse.Namespace) -> int:
    from gpuguard.config import ConfigError
    from gpuguard.report.incident import BundleError, make_incident_report

    try:
        path = incident_dir(args.incident, args.config)
        out = args.output or f"gpuguard-incident-{os.path.basename(os.path.normpath(path))}.html"
        png_path = os.path.splitext(out)[0] + ".png"
        rep = make_incident_report(path, png_name=os.path.basename(png_path))
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 2
    except BundleError as e:
        print(f"gpuguard report: {e}", file=sys.stderr)
        return 1
    if not write_report(rep, out, png_path):
        return 1
    n = sum(len(e["t"]) for e in rep.window.engines.values())
    print(f"incident {rep.name}: {rep.decision.get('reason')} on {rep.decision.get('engine')}, "
          f"{len(rep.processes)} processes, {n} engine readings, {len(rep.window.gpus)} GPUs")
    print(f"  {out}\n  {png_path}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from gpuguard.config import ConfigError
    from gpuguard.report.make import make_report, pick_focus
    from gpuguard.report.history import FlightLog, HistoryError, parse_duration, parse_time

    if args.incident is not None:
        return cmd_incident(args)
    try:
        before, after = parse_duration(args.before), parse_duration(args.after)
        at = parse_time(args.at) if args.at else None
    except ValueError as e:
        print(f"gpuguard report: {e}", file=sys.stderr)
        return 2
    out = args.output
    try:
        flight = FlightLog.open(db_path(args))
        if out is None:
            focus, _ = pick_focus(flight, args.event, at)
            out = time.strftime("gpuguard-report-%Y%m%d-%H%M%S.html", time.localtime(focus))
        png_path = os.path.splitext(out)[0] + ".png"
        rep = make_report(flight, event_id=args.event, at=at, before=before, after=after, gpu=args.gpu,
                          png_name=os.path.basename(png_path))
    except (HistoryError, ConfigError) as e:
        print(f"gpuguard report: {e}", file=sys.stderr)
        return 1
    if not write_report(rep, out, png_path):
        return 1
    what = f"{rep.event['kind']} (event {rep.event['id']})" if rep.event else "the last sample"
    n = sum(len(g["t"]) for g in rep.window.gpus.values())
    print(f"report on {what} at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(rep.focus))}: "
          f"{len(rep.window.gpus)} GPUs, {n} samples, {len(rep.window.events)} events")
    print(f"  {out}\n  {png_path}")
    return 0
