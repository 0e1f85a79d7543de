"""`gpuguard engines [--json] [--api URL]`: each watched engine's state, PID, running/waiting,
tokens/s, no-progress seconds and last action, as the running daemon sees them (read from
its API; this command never probes engines itself, so it shows what the watchdog acts on)."""
from __future__ import annotations

import json
import sys

import httpx

from gpuguard.cli._daemon_api import add_api_argument, daemon_api


def register(subparsers) -> None:
    p = subparsers.add_parser("engines", help="inference engines: state, progress, last action",
                              description=__doc__)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_api_argument(p)
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the daemon")
    p.set_defaults(func=run)


def _fmt(v, spec: str = "", none: str = "-") -> str:
    if v is None:
        return none
    return format(v, spec) if spec else str(v)


def _num(v) -> str:
    if v is None:
        return "-"
    return str(int(v)) if float(v).is_integer() else f"{v:.1f}"


def fetch(api: str, timeout: float) -> list[dict]:
    url = api.rstrip("/") + "/v1/engines"
    resp = httpx.get(url, timeout=timeout, trust_env=False)
    if resp.status_code != 200:
        raise RuntimeError(f"{url} answered HTTP {resp.status_code}: {resp.text[:200]}")
    data = resp.json()
    engines = data.get("engines", data) if isinstance(data, dict) else data
    if not isinstance(engines, list):
        raise RuntimeError(f"{url}: expected a list of engines, got {type(engines).__name__}")
    return engines


def run(args) -> int:
    api = daemon_api(args)
    url = api.url("/v1/engines")
    try:
        engines = fetch(api.base, args.timeout)
    except (httpx.HTTPError, OSError) as exc:
        msg = (f"gpuguard daemon API not reachable at {url} (from {api.source}; {type(exc).__name__}: {exc}). "
               "Engine state comes from the running daemon: is `gpuguard run` up, and do --api / "
               "$GPUGUARD_API point at it?")
        if args.json:
            print(json.dumps({"error": msg, "api": url}))
        print(msg, file=sys.stderr)
        return 1
    except (RuntimeError, ValueError) as exc:
        msg = f"gpuguard daemon API at {url} gave an unusable answer: {exc}"
        if args.json:
            print(json.dumps({"error": msg, "api": url}))
        print(msg, file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"engines": engines}, indent=2, sort_keys=True))
        return 0
    if not engines:
        print("no engines configured (engines: in the config)")
        return 0
    cols = ("ENGINE", "KIND", "STATE", "PID", "RUN", "WAIT", "TOK/S", "NO-PROGRESS", "DECODE-GAP", "LONGEST-PAUSE-TODAY",
            "LAST ACTION")
    rows = []
    for e in engines:
        state = e.get("state", "?")
        if e.get("reason"):
            state += f" ({e['reason']})"
        rows.append((
            e.get("name", "?"), e.get("kind", "?"), state, _fmt(e.get("pid")),
            _num(e.get("requests_running")), _num(e.get("requests_waiting")),
            _fmt(e.get("tokens_per_second"), ".1f"),
            f"{e.get('no_progress_seconds') or 0:.1f}s",
            _fmt(e.get("decode_gap_seconds"), ".1f"),
            _fmt(e.get("longest_pause_today_seconds"), ".1f"),
            e.get("last_action") or "-",
        ))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    for e in engines:
        if e.get("error"):
            print(f"{e.get('name')}: {e['error']}", file=sys.stderr)
    return 0
