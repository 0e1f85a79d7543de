"""`gpuguard events`: kernel and device events.

- `gpuguard events [--json] [--since DURATION]` lists the running daemon's events (control
  API `GET /v1/events`);
- `gpuguard events classify FILE|- [--json] [--all] [--rules FILE]` classifies a saved
  `dmesg`, `dmesg -T`, `journalctl -k`, syslog or raw /dev/kmsg text with the same rules
  the daemon uses, to ask "what happened last night" of an old log.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from typing import Any, TextIO

from gpuguard.cli._daemon_api import add_api_argument, daemon_api

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)?\s*$")
_UNITS = {None: 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """`90`, `30s`, `10m`, `2h`, `1d` → seconds."""
    m = _DURATION_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (examples: 30s, 10m, 2h, 1d)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("events", help="kernel and device events (daemon, or a saved log)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--since", type=parse_duration, default=None, metavar="DURATION",
                   help="only events newer than this (30s, 10m, 2h, 1d)")
    add_api_argument(p)
    p.add_argument("--timeout", type=float, default=2.0, help="API timeout in seconds")
    p.set_defaults(func=cmd_events)
    sub = p.add_subparsers(dest="events_command", metavar="SUBCOMMAND")
    c = sub.add_parser("classify", help="classify a saved dmesg / journalctl -k / raw kmsg log")
    c.add_argument("file", metavar="FILE|-", help="log file, or - for standard input")
    c.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    c.add_argument("--all", action="store_true", help="also list lines no rule matched")
    c.add_argument("--rules", metavar="FILE", default=None, help="extra rules YAML (tried first)")
    c.add_argument("--no-builtin", action="store_true", help="use only the rules from --rules")
    c.set_defaults(func=cmd_classify)


# ── gpuguard events (daemon) ─────────────────────────────────────────────────────
def cmd_events(args: argparse.Namespace) -> int:
    import httpx

    params: dict[str, Any] = {}
    if args.since is not None:
        params["since"] = time.time() - args.since
    api = daemon_api(args)
    url = api.url("/v1/events")
    try:
        resp = httpx.get(url, params=params, timeout=args.timeout, trust_env=False)
    except httpx.TransportError as e:
        print(f"gpuguard events: no gpuguard daemon API reachable at {api.describe()} ({type(e).__name__}: {e}).\n"
              "Start the daemon (`gpuguard run` / `systemctl start gpuguard`) or point --api / "
              "$GPUGUARD_API at it.\nTo classify a saved log instead: gpuguard events classify FILE",
              file=sys.stderr)
        return 1
    if resp.status_code != 200:
        print(f"gpuguard events: {url} answered HTTP {resp.status_code}: {resp.text[:200]}", file=sys.stderr)
        return 1
    try:
        data = resp.json()
    except ValueError:
        print(f"gpuguard events: {url} did not answer JSON: {resp.text[:200]!r}", file=sys.stderr)
        return 1
    events = data.get("events", []) if isinstance(data, dict) else data
    if not isinstance(events, list):
        print(f"gpuguard events: {url} answered no event list", file=sys.stderr)
        return 1
    if args.since is not None:
        cutoff = time.time() - args.since
        events = [e for e in events if isinstance(e, dict) and e.get("time", cutoff) >= cutoff]
    if args.json:
        json.dump({"events": events}, sys.stdout, indent=2)
        print()
        return 0
    if not events:
        print("no events" + (" in that window" if args.since is not None else ""))
        return 0
    for e in events:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.get("time", 0)))
        where = e.get("gpu") or e.get("bdf") or "host"
        print(f"{when}  {e.get('severity', '?'):8} {e.get('kind', '?'):22} {where:14} {e.get('message', '')}")
    return 0


# ── gpuguard events classify ─────────────────────────────────────────────────────
def _open_input(name: str) -> TextIO | None:
    if name == "-":
        return sys.stdin
    try:
        return open(name, "rb")  # type: ignore[return-value]
    except FileNotFoundError:
        print(f"gpuguard events classify: {name}: no such file. Save a log first, e.g. "
              "`dmesg > kern.txt` or `journalctl -k -b -1 > kern.txt`", file=sys.stderr)
    except IsADirectoryError:
        print(f"gpuguard events classify: {name} is a directory, not a log file", file=sys.stderr)
    except OSError as e:
        print(f"gpuguard events classify: cannot open {name}: {e.strerror}", file=sys.stderr)
    return None


def classify_entries(lines, rules) -> tuple[list[dict[str, Any]], int]:
    """(entries as dicts, number of messages) for the lines of a saved log."""
    from gpuguard.kernel.classify import attribute
    from gpuguard.kernel.saved_log import parse_saved_log

    out: list[dict[str, Any]] = []
    total = 0
    for entry in parse_saved_log(lines):
        total += 1
        match = rules.classify(entry.text)
        item: dict[str, Any] = {"line": entry.line_no, "stamp": entry.stamp, "format": entry.format,
                                "text": entry.text}
        if match is None:
            item["kind"] = None
        else:
            _, bdf = attribute(entry.record, match, None)
            item.update({
                "kind": match.kind, "severity": match.severity, "condition": match.condition,
                "bdf": bdf, "bdf_all": list(match.bdf_all), "xid": match.xid,
                "fields": dict(match.fields), "rule": match.rule,
            })
            if entry.record is not None:
                item["seq"] = entry.record.seq
        out.append(item)
    return out, total


def cmd_classify(args: argparse.Namespace) -> int:
    from gpuguard.kernel.rules import Rules, RulesError

    as_json = getattr(args, "json", False)
    try:
        rules = Rules.load(builtin=not args.no_builtin, extra_file=args.rules)
    except RulesError as e:
        print(f"gpuguard events classify: {e}", file=sys.stderr)
        return 2
    stream = _open_input(args.file)
    if stream is None:
        return 2
    try:
        source = stream.buffer if stream is sys.stdin else stream
        entries, total = classify_entries(source, rules)
    finally:
        if stream is not sys.stdin:
            stream.close()
    matched = [e for e in entries if e["kind"]]
    by_kind = Counter(e["kind"] for e in matched)
    shown = entries if args.all else matched
    name = "<stdin>" if args.file == "-" else args.file
    if as_json:
        json.dump({"file": name, "messages": total, "classified": len(matched),
                   "by_kind": dict(sorted(by_kind.items())), "entries": shown}, sys.stdout, indent=2)
        print()
        return 0
    if total == 0:
        print(f"{name}: no kernel messages found (empty file, or no line had kernel text)")
        return 0
    for e in shown:
        text = e["text"].replace("\n", " ⏎ ")
        if len(text) > 110:
            text = text[:107] + "..."
        if e["kind"]:
            extra = f" xid={e['xid']}" if e.get("xid") is not None else ""
            print(f"{e['line']:>6}  {e['severity']:8} {e['kind']:22} {e.get('bdf') or 'host':13}{extra}  {text}")
        else:
            print(f"{e['line']:>6}  {'-':8} {'-':22} {'':13}  {text}")
    summary = ", ".join(f"{k} {n}" for k, n in by_kind.most_common())
    print(f"{name}: {total} messages, {len(matched)} classified" + (f": {summary}" if summary else ""))
    return 0
