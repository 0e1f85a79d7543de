"""`gpuguard status`: one table a person reads at a glance (name, PCI address, model,
power/cap, temperatures, clocks, fan, busy, VRAM, OD state); `--json` for scripts.

With `--sysfs-root` it reads the hardware once itself; otherwise it asks the running
daemon's API (`--api`, else $GPUGUARD_API, else the listen: of `--config`, else
127.0.0.1:9436), so it shows what the daemon sees. A daemon named by `--api` or $GPUGUARD_API that does
not answer is an error (exit 2, the URL named); otherwise, with no daemon answering, it
reads this host itself and its first line says so."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from gpuguard.cli._daemon_api import DaemonApi, add_api_argument, daemon_api


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="GPU table (from the daemon, or read directly)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--sysfs-root", metavar="DIR", default=None, help="read hardware below DIR (no daemon)")
    p.add_argument("--config", "-c", metavar="FILE", default=None, help="config file (GPU names)")
    add_api_argument(p)
    p.set_defaults(func=cmd_status)


def read_local(sysfs_root: str, config: Any) -> list[dict[str, Any]]:
    return read_local_doc(sysfs_root, config)["gpus"]


def read_local_doc(sysfs_root: str, config: Any) -> dict[str, Any]:
    """One poll of the hardware: the GPUs, the summary line (configured vs present) and
    the configured cards that are missing (state/identity.py fails closed)."""
    from gpuguard.hw.sources import default_sources
    from gpuguard.hw.sysfs import SysfsRoot
    from gpuguard.poller import GpuPoller
    from gpuguard.state.hub import Hub

    root = SysfsRoot(sysfs_root)
    hub = Hub()
    poller = GpuPoller(hub, default_sources(root), config.gpus, timeout=config.poll.timeout_seconds)
    try:
        snap = asyncio.run(poller.poll_once())
    finally:
        poller.close()
    return {"gpus": [g.to_dict() for g in snap.gpus], "summary": hub.gpus.summary(),
            "missing": [{"gpu": m.name, "match": m.match, "why": m.why} for m in hub.gpus.missing()],
            "gpu_processes": local_gpu_processes(root, {g.bdf: g.name for g in snap.gpus})}


def local_gpu_processes(root: Any, names: dict[str, str]) -> dict[str, Any]:
    """Without a daemon: the DRM clients under the root's /proc (no engine is known here)."""
    import time

    from gpuguard.engines.attribution import scan_fdinfo

    procs = [{"gpu": names.get(g.bdf, g.bdf), "bdf": g.bdf, "pid": g.pid, "comm": g.comm, "engine": None,
              "vram_bytes": g.vram_bytes, "source": g.source} for g in scan_fdinfo(root.path("/proc"))]
    return {"scanned_at": time.time(), "processes": sorted(procs, key=lambda p: (p["gpu"], p["pid"]))}


def render_processes(doc: dict[str, Any] | None) -> str:
    """One line per process holding a GPU: `xtx-0  pid 4242  VLLM::EngineCor  engine vllm-a  512 MiB`."""
    procs = (doc or {}).get("processes") or []
    if not procs:
        return ""
    rows = [[p["gpu"], f"pid {p['pid']}", p["comm"], f"engine {p['engine']}" if p.get("engine") else "(no engine)",
             "?" if p.get("vram_bytes") is None else f"{p['vram_bytes'] / 2**20:.0f} MiB"] for p in procs]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "GPU processes:\n" + "\n".join("  " + "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows)


class NoDaemon(Exception):
    """No usable /v1/status there; the message says why (refused, HTTP 401, not JSON)."""


def ask_daemon(api: DaemonApi) -> dict[str, Any]:
    """The running daemon's /v1/status."""
    import httpx

    url = api.url("/v1/status")
    try:
        r = httpx.get(url, timeout=3.0, trust_env=False)
    except httpx.HTTPError as e:
        raise NoDaemon(f"{type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise NoDaemon(f"{url} answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        doc = r.json()
    except ValueError:
        raise NoDaemon(f"{url} did not answer JSON: {r.text[:200]!r}") from None
    if not isinstance(doc, dict):
        raise NoDaemon(f"{url} answered no status document")
    return doc


def _fmt(v: float | None, spec: str, unit: str = "") -> str:
    return "?" if v is None else f"{v:{spec}}{unit}"


def temps_text(t: dict[str, float]) -> str:
    """edge/junction/mem on AMD, the single `gpu` sensor on NVIDIA."""
    if "edge" in t or "junction" in t:
        return "/".join(_fmt(t.get(k), ".0f") for k in ("edge", "junction", "mem")) + " e/j/m"
    return " ".join(f"{v:.0f} {k}" for k, v in sorted(t.items())) or "?"


def od_summary(od: dict[str, Any] | None, od_error: str | None) -> str:
    if od is None:
        return "off" if od_error else "n/a"
    s = od.get("settings", {})
    parts = []
    for key, label in (
        ("sclk_offset_mhz", "sclk{:+d}"),
        ("sclk_max_mhz", "sclk≤{}"),
        ("mclk_max_mhz", "mclk≤{}"),
        ("vddgfx_offset_mv", "vo{:+d}"),
    ):
        if key in s:
            parts.append(label.format(int(s[key])))
    for clk, rows in (od.get("levels") or {}).items():
        if rows:  # per-level tables (Polaris, Vega10): the top level is what the card boosts to
            parts.append(f"{clk}≤{rows[-1]['mhz']}@{rows[-1]['mv']}mV")
    return " ".join(parts) or od.get("format", "?")


def profile_cell(profiles: dict[str, Any], gpu: str) -> str:
    r = (profiles.get("gpus") or {}).get(gpu)
    if not r:
        return ""
    return f"{r.get('profile')} {'✓' if r.get('verified') else '✗ ' + str(r.get('result'))}"


def render_table(gpus: list[dict[str, Any]], profiles: dict[str, Any] | None = None) -> str:
    profiles = profiles or {}
    head = ["GPU", "BDF", "MODEL", "POWER/CAP W", "TEMP °C", "SCLK/MCLK MHz", "FAN", "BUSY", "VRAM GiB", "OD"]
    with_profiles = bool(profiles.get("gpus"))
    if with_profiles:
        head.append("PROFILE")
    rows = []
    for g in gpus:
        if not g["up"]:
            reason = "; ".join(g.get("errors", {}).values()) or "down"
            rows.append([g["name"], g["bdf"], g["model"], f"DOWN: {reason}", "", "", "", "", "", ""])
            continue
        if g.get("runtime_status") == "suspended":
            rows.append([g["name"], g["bdf"], g["model"], "suspended (not woken)", "", "", "", "", "", ""])
            continue
        t = g["temperatures_celsius"]
        c = g["clocks_hz"]
        rows.append(
            [
                g["name"],
                g["bdf"],
                g["model"],
                f"{_fmt(g['power_watts'], '.0f')}/{_fmt(g['power_cap_watts'], '.0f')}",
                temps_text(t),
                "/".join(_fmt(None if c.get(k) is None else c[k] / 1e6, ".0f") for k in ("sclk", "mclk")),
                _fmt(g["fan_rpm"], ".0f"),
                _fmt(None if g["busy_ratio"] is None else g["busy_ratio"] * 100, ".0f", "%"),
                f"{_fmt(None if g['vram_used_bytes'] is None else g['vram_used_bytes'] / 2**30, '.1f')}"
                f"/{_fmt(None if g['vram_total_bytes'] is None else g['vram_total_bytes'] / 2**30, '.1f')}",
                od_summary(g.get("od"), g.get("od_error")),
            ]
        )
    if with_profiles:
        for r, g in zip(rows, gpus):
            r.append(profile_cell(profiles, g["name"]))
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in [head] + rows]
    notes = []
    for g in gpus:
        for key, why in sorted(g.get("errors", {}).items()):
            if g["up"]:
                notes.append(f"  {g['name']}: {key} unreadable: {why}")
        if g.get("od_error"):
            notes.append(f"  {g['name']}: {g['od_error']}")
    for finding in profiles.get("findings") or ():
        notes.append(f"  {finding}")
    if profiles.get("safe_mode"):
        notes.append(f"  profiles: SAFE MODE: {profiles['safe_mode']}")
    if not gpus:
        lines.append("(no GPUs found)")
    return "\n".join(lines + (["", "notes:"] + notes if notes else []))


def cmd_status(args: argparse.Namespace) -> int:
    from gpuguard.config import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 2
    doc = None
    source = None  # the first line: what was read, unless --sysfs-root asked for this host
    if args.sysfs_root is None:
        api = daemon_api(args, config.listen if args.config else None)
        try:
            doc = ask_daemon(api)
            source = f"from the daemon at {api.describe()}"
        except NoDaemon as e:
            if api.named:  # the user meant that daemon: this host's cards are not the answer
                print(f"gpuguard status: no gpuguard daemon answers at {api.describe()}: {e}.\n"
                      "Start it (`gpuguard run` / `systemctl start gpuguard`), or fix the URL; "
                      "`--sysfs-root /` reads this host directly.", file=sys.stderr)
                return 2
            source = f"no daemon at {api.describe()}; this host read directly below {config.sysfs_root}"
    if doc is None:
        doc = read_local_doc(args.sysfs_root or config.sysfs_root, config)
    gpus = doc.get("gpus", [])
    missing = doc.get("missing") or []
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        if source:
            print(f"gpuguard status: {source}", file=sys.stderr)
    else:
        if source:
            print(source)
        if doc.get("summary"):
            print(doc["summary"])  # configured vs present: `3/4 GPUs up; missing xtx-0 (1002:744c #0)`
        print(render_table(gpus, doc.get("profiles")))
        procs = render_processes(doc.get("gpu_processes"))
        if procs:
            print("\n" + procs)
        for m in missing:
            print(f"MISSING {m['gpu']} ({m['match']}): {m['why']}")
    return 0 if all(g["up"] for g in gpus) and not missing else 1
