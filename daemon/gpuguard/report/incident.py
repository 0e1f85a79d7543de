"""An engine incident bundle (engines/incidents.py) as a report: the same self-contained
HTML (inline SVG, no script) and PNG as a flight-recorder report, drawn from the bundle's
own files so it renders on any machine the folder is copied to:

- the stall decision and its evidence, the graded times, what the bundle could not take;
- each engine process: state, wchan, CPU times, /proc/PID/stack, every thread, GPU files;
- every thread's Python stack (py-spy) where the bundle has one;
- the engine's readings of the last minutes as charts (tokens/s, no-progress seconds,
  requests, the step counter that stopped), the GPU telemetry of the same minutes;
- the kernel lines of those minutes.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from gpuguard import __version__
from gpuguard.report.figure import PALETTE, Figure, Panel, Series, _range, build_figure
from gpuguard.report.html import CSS, _clock, _rel
from gpuguard.report.png import render_png
from gpuguard.report.svg import render_svg
from gpuguard.report.history import ENGINE_SERIES, GPU_SERIES, Window

REQUIRED = ("decision.json", "processes.json")
MAX_STACK_CHARS = 20000  # one py-spy dump shown in the page; the file keeps all of it


class BundleError(Exception):
    """The folder is not a readable incident bundle; the message names the file."""


@dataclass(frozen=True)
class IncidentReport:
    name: str
    decision: dict[str, Any]
    processes: list[dict[str, Any]]
    window: Window
    figure: Figure
    html: str
    png: bytes


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise BundleError(f"{path}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise BundleError(f"{path}: not JSON: {e}") from None


def read_bundle(path: Path | str) -> dict[str, Any]:
    """The bundle's files, parsed. Only decision.json and processes.json are required: a
    bundle whose background parts were abandoned still renders, and says what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise BundleError(f"{path}: no such incident bundle folder (gpuguard engines / GET /v1/incidents list them)")
    for name in REQUIRED:
        if not (path / name).is_file():
            raise BundleError(f"{path}: not an incident bundle: {name} missing")
    out: dict[str, Any] = {"name": path.name, "path": str(path), "decision": _json(path / "decision.json"),
                           "processes": _json(path / "processes.json")}
    out["summary"] = _json(path / "summary.json") if (path / "summary.json").is_file() else None
    out["context"] = _json(path / "context.json") if (path / "context.json").is_file() else None
    samples: list[dict[str, Any]] = []
    if (path / "samples.jsonl").is_file():
        for n, line in enumerate((path / "samples.jsonl").read_text(errors="replace").splitlines(), 1):
            try:
                samples.append(json.loads(line))
            except ValueError:
                # the size bound may cut the last line: keep what parses, say what did not
                samples.append({"unparsed_line": n})
    out["samples"] = samples
    out["pyspy"] = {int(p.stem.split("-")[-1]): p.read_text(errors="replace")
                    for p in sorted(path.glob("py-spy-*.txt")) if p.stem.split("-")[-1].isdigit()}
    return out


def bundle_window(b: dict[str, Any]) -> Window:
    """The bundle's readings in the flight recorder's Window shape, so the report's figure
    code draws them: GPU rows from context.json, engine rows from samples.jsonl, the
    kernel lines as events, and the decision itself as an event at its moment."""
    decision, engine = b["decision"], b["decision"].get("engine") or b["name"].rsplit("-", 1)[0]
    ctx = b["context"] or {}
    gpus: dict[str, dict[str, list]] = {}
    for s in ctx.get("gpu_samples") or ():
        g = gpus.setdefault(s["gpu"], {"bdf": s.get("bdf"), "t": [], **{k: [] for k in GPU_SERIES}})
        g["t"].append(s["t"])
        for k in GPU_SERIES:
            g[k].append(s.get(k))
    readings = [s for s in b["samples"] if "t" in s and "state" in s]
    engines: dict[str, dict[str, list]] = {}
    if readings:
        e = engines[engine] = {"t": [], "state": [], "heartbeat": [], **{k: [] for k in ENGINE_SERIES}}
        for s in readings:
            r = s.get("reading") or {}
            e["t"].append(s["t"])
            e["state"].append(s["state"])
            e["tokens_per_s"].append(s.get("tokens_per_second"))
            e["no_progress_s"].append(s.get("no_progress_seconds"))
            e["tokens_total"].append(r.get("live_tokens") if r.get("live_tokens") is not None else r.get("tokens"))
            e["running"].append(r.get("running"))
            e["waiting"].append(r.get("waiting"))
            e["heartbeat"].append(r.get("heartbeat"))
    events = [dict(x, id=None) for x in ctx.get("kernel_lines") or ()]
    at = decision.get("time") or (b["summary"] or {}).get("time")
    events.append({"id": None, "time": at, "kind": "engine_incident", "severity": "alert", "source": "engine",
                   "gpu": None, "bdf": None, "engine": engine,
                   "message": f"{decision.get('reason')}: bundle taken, action {decision.get('action')}"})
    events.sort(key=lambda x: x["time"])
    times = [t for g in gpus.values() for t in g["t"]] + [t for e in engines.values() for t in e["t"]] + [at]
    # the span the readings cover (context.json's `since` is the window asked for, which
    # may reach back before the engine's first reading)
    start, end = min(times), max(times)
    return Window(start, end, gpus, engines, events)


def incident_figure(window: Window, focus: float) -> Figure:
    """The flight-recorder figure (GPU panels, tokens/s, no progress) plus the two engine
    panels a stall shows best: requests running/waiting, and the step counter going flat."""
    base = build_figure(window, focus)
    panels = list(base.panels)
    for title, unit, cols in (("engine requests", "requests", ("running", "waiting")),
                              ("engine step counter", "steps", ("heartbeat",))):
        series, allv = [], []
        for name in sorted(window.engines):
            e = window.engines[name]
            for j, col in enumerate(cols):
                vs = tuple(e.get(col) or ())
                if not vs or all(v is None for v in vs):
                    continue
                allv += [v for v in vs if v is not None]
                series.append(Series(f"{name} {col}", f"{name} {col}", PALETTE[j % len(PALETTE)], tuple(e["t"]), vs))
        if series:
            y0, y1 = _range(allv)
            panels.append(Panel(title, unit, tuple(series), y0, y1))
    return Figure(base.t0, base.t1, focus, tuple(panels), base.markers)


def _pre(text: str | None, cls: str = "") -> str:
    return f'<pre class="{cls}">{escape(text or "")}</pre>'


def _kv_rows(d: dict[str, Any]) -> str:
    return "".join(f'<tr><th>{escape(str(k))}</th><td class="msg">{escape(json.dumps(v, default=str) if not isinstance(v, str) else v)}</td></tr>'
                   for k, v in d.items())


def _process_html(p: dict[str, Any], pyspy: str | None) -> str:
    pid = p.get("pid")
    if p.get("gone"):
        return f'<section class="process" data-pid="{pid}"><h3>PID {pid}: gone before it could be read</h3></section>'
    head = (f'<tr><th>state</th><td class="state">{escape(str(p.get("state", "?")))}</td></tr>'
            f'<tr><th>wchan</th><td class="wchan">{escape(str(p.get("wchan") or "-"))}</td></tr>'
            f'<tr><th>CPU</th><td>user {p.get("utime_seconds", 0):.2f} s, system {p.get("stime_seconds", 0):.2f} s</td></tr>'
            f'<tr><th>command</th><td class="msg">{escape(p.get("cmdline") or "")}</td></tr>'
            + _kv_rows(p.get("status") or {}))
    threads = "".join(
        f'<tr><td>{t.get("tid")}</td><td>{escape(t.get("comm") or "")}</td><td class="state">{escape(str(t.get("state", "?")))}</td>'
        f'<td class="wchan">{escape(t.get("wchan") or "-")}</td><td>{t.get("utime_seconds", 0):.2f} / {t.get("stime_seconds", 0):.2f}</td></tr>'
        for t in p.get("threads") or ())
    fds = "".join(f'<li>fd {escape(str(f.get("fd")))} → {escape(f.get("target") or "")}{_pre(f.get("fdinfo"), "fdinfo")}</li>'
                  for f in p.get("gpu_fds") or ())
    stacks = ""
    if pyspy is not None:
        cut = "" if len(pyspy) <= MAX_STACK_CHARS else f"\n… {len(pyspy) - MAX_STACK_CHARS} more characters in py-spy-{pid}.txt"
        stacks = f'<h4>Python threads (py-spy dump)</h4>{_pre(pyspy[:MAX_STACK_CHARS] + cut, "pyspy")}'
    return (f'<section class="process" data-pid="{pid}"><h3>PID {pid} {escape(p.get("comm") or "")}</h3>'
            f'<table class="kv">{head}</table>'
            f'<h4>Kernel stack (/proc/{pid}/stack)</h4>{_pre(p.get("stack"), "stack")}'
            f'<h4>Threads</h4><table class="threads"><thead><tr><th>tid</th><th>comm</th><th>state</th><th>wchan</th>'
            f'<th>CPU user/sys s</th></tr></thead><tbody>{threads}</tbody></table>'
            + (f'<h4>Open GPU files</h4><ul>{fds}</ul>' if fds else "") + stacks + "</section>")


def render_incident_html(b: dict[str, Any], window: Window, fig: Figure, png_name: str | None = None) -> str:
    d = b["decision"]
    focus = fig.focus if fig.focus is not None else window.end
    engine = d.get("engine") or b["name"]
    title = f"{d.get('reason') or 'stall'} {engine}"
    summary = b["summary"] or {"complete": False, "notes": ["summary.json missing: the bundle was still being "
                                                          "written, or its writer was stopped"]}
    notes = "".join(f"<li>{escape(n)}</li>" for n in summary.get("notes") or ()) or "<li>nothing abandoned or truncated</li>"
    graded = d.get("graded") or {}
    graded_line = ", ".join(f"{k} {v:g} s" for k, v in graded.items() if isinstance(v, (int, float)))
    missing = [what for what, have in (("py-spy stacks", b["pyspy"]), ("GPU telemetry and kernel lines", b["context"]),
                                        ("engine readings", window.engines)) if not have]
    rows = []
    for e in window.events:
        rows.append(f'<tr><td>{_rel(e["time"], focus)}</td><td>{escape(_clock(e["time"])[11:])}</td>'
                    f'<td class="sev">{escape(e.get("severity") or "")}</td><td>{escape(e.get("kind") or "")}</td>'
                    f'<td>{escape(e.get("source") or "")}</td>'
                    f'<td>{escape(" ".join(x for x in (e.get("gpu"), e.get("engine")) if x))}</td>'
                    f'<td class="msg">{escape(e.get("message") or "")}</td></tr>')
    procs = "".join(_process_html(p, b["pyspy"].get(p.get("pid"))) for p in b["processes"])
    png = f'<p>PNG: <a href="{escape(png_name)}">{escape(png_name)}</a></p>' if png_name else ""
    css = CSS + "pre{background:#f6f6f6;padding:.4rem;overflow-x:auto;font-size:.8rem} .kv th{width:12rem}"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1"><link rel="icon" href="data:,">
<title>gpuguard incident: {escape(title)} at {escape(_clock(focus))}</title><style>{css}</style></head>
<body>
<h1 id="headline">{escape(title)} — {escape(_clock(focus))}</h1>
<p class="sub">Incident bundle {escape(b["name"])} ({'complete' if summary.get('complete') else 'INCOMPLETE'}); action
{escape(str(d.get("action")))}; graded: {escape(graded_line or "n/a")}. From {escape(b["path"])}.</p>
{f'<p class="sub gap">Not in this bundle: {escape(", ".join(missing))}.</p>' if missing else ''}
<h2>The decision and its evidence</h2>
<table id="evidence" class="kv">{_kv_rows(d.get("evidence") or {})}</table>
<h3>What the bundle could not take</h3><ul id="notes">{notes}</ul>
<h2>Readings of those minutes</h2>
{render_svg(fig)}
<h2>Engine processes</h2>
<div id="processes">{procs or '<p>no process was found</p>'}</div>
<h2>Kernel lines and the decision</h2>
<table id="events"><thead><tr><th>rel</th><th>time</th><th>severity</th><th>kind</th><th>source</th><th>where</th>
<th>message</th></tr></thead><tbody>{''.join(rows)}</tbody></table>
{png}
<p class="sub">gpuguard {escape(__version__)} · generated {escape(_clock(time.time()))}</p>
</body></html>
"""


def make_incident_report(path: Path | str, png_name: str | None = None) -> IncidentReport:
    b = read_bundle(path)
    window = bundle_window(b)
    focus = b["decision"].get("time") or window.end
    fig = incident_figure(window, focus)
    html = render_incident_html(b, window, fig, png_name)
    png = render_png(fig, f"gpuguard incident: {b['decision'].get('reason')} {b['decision'].get('engine')}")
    return IncidentReport(b["name"], b["decision"], b["processes"], window, fig, html, png)
