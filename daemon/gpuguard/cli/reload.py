"""`gpuguard reload --pid PID`: send SIGHUP to a running daemon and wait until it has
re-read its config (exit 0) or refused it (exit 1). The unit's ExecReload= — so
`systemctl reload gpuguard` returns only once the new config is in effect, and fails,
leaving the old config running, when the file is invalid (sinks/reload_marker.py)."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reload", help="reload a running daemon's config and wait for the outcome", description=__doc__)
    p.add_argument("--pid", type=int, required=True, help="the daemon's PID (systemd: $MAINPID)")
    p.add_argument("--record", metavar="FILE", default=None,
                   help="reload record the daemon writes (default: $RUNTIME_DIRECTORY/reload.json, /run/gpuguard/reload.json)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the daemon (default 60)")
    p.set_defaults(func=cmd_reload)


def cmd_reload(args: argparse.Namespace) -> int:
    from gpuguard.sinks.reload_marker import FILE_NAME, default_path, read

    path = Path(args.record) if args.record else (default_path() or Path("/run/gpuguard") / FILE_NAME)
    before = read(path)
    # a record of an earlier daemon (other PID) does not count: this one starts at 0
    seen = before["generation"] if before and before.get("pid") == args.pid else 0
    try:
        os.kill(args.pid, signal.SIGHUP)
    except ProcessLookupError:
        print(f"gpuguard reload: no process {args.pid}", file=sys.stderr)
        return 1
    except PermissionError:
        print(f"gpuguard reload: not allowed to signal process {args.pid} (run as root)", file=sys.stderr)
        return 1
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        doc = read(path)
        if doc and doc.get("pid") == args.pid and doc.get("generation", 0) > seen:
            if doc.get("ok"):
                print(f"gpuguard reload: config applied (reload {doc['generation']} of pid {args.pid})")
                return 0
            print("gpuguard reload: config refused, the running config is kept; "
                  "`journalctl -u gpuguard` names the key and line", file=sys.stderr)
            return 1
        try:
            os.kill(args.pid, 0)
        except ProcessLookupError:
            print(f"gpuguard reload: process {args.pid} exited during the reload", file=sys.stderr)
            return 1
        time.sleep(0.05)
    print(f"gpuguard reload: no answer in {args.timeout:g} s from pid {args.pid} in {path} "
          "(is it a gpuguard daemon started with RuntimeDirectory=gpuguard?)", file=sys.stderr)
    return 1
