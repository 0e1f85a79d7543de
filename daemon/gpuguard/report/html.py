"""The report as one self-contained HTML file: what happened (the event, or the last
sample before the recording stopped), the figure as inline SVG on one time axis, and the
kernel lines and gpuguard events of the window in a table. No script, no external asset:
it opens from a USB stick on an air-gapped host."""
from __future__ import annotations

import time
from html import escape
from typing import Any

from gpuguard import __version__
from gpuguard.report.figure import SEVERITY_COLOUR, Figure
from gpuguard.report.svg import render_svg
from gpuguard.report.history import Window

CSS = """
body{font-family:system-ui,sans-serif;margin:1rem auto;max-width:1000px;color:#222;padding:0 .5rem}
h1{font-size:1.3rem;margin:.2rem 0} .sub{color:#555;margin:.2rem 0 1rem}
.figure{max-width:100%;height:auto} table{border-collapse:collapse;width:100%;font-size:.85rem}
td,th{border-bottom:1px solid #ddd;padding:.2rem .4rem;text-align:left;vertical-align:top}
td.msg{font-family:ui-monospace,monospace;word-break:break-word} tr.focus{background:#fff3e0}
.sev{font-weight:bold} .gap{color:#b00020;font-weight:bold}
"""


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t * 10) % 10}"


def _rel(t: float, focus: float) -> str:
    d = t - focus
    return f"{'+' if d >= 0 else '-'}{abs(d):.1f} s"


def headline(window: Window, focus: float, event: dict[str, Any] | None) -> tuple[str, str]:
    """(title, one line of context)."""
    if event is not None:
        where = " ".join(x for x in (event.get("gpu"), event.get("engine")) if x)
        title = f"{event['kind']} {where}".strip()
        return title, f"{event['severity']}: {event['message']}"
    last = max((g["t"][-1] for g in window.gpus.values() if g["t"]), default=None)
    if last is not None and abs(last - focus) < 2 and focus < window.end - 5:
        return ("recording stopped", "no sample after this moment, no kernel line and no clean stop: the host "
                "lost power or froze, or gpuguard was killed (a PSU trip leaves exactly this, INCIDENTS §2)")
    return "moment", f"{_clock(focus)}"


def render_html(window: Window, fig: Figure, focus: float, event: dict[str, Any] | None, source: str,
                png_name: str | None = None) -> str:
    title, context = headline(window, focus, event)
    rows = []
    for e in window.events:
        cls = ' class="focus"' if event is not None and e.get("id") == event.get("id") else ""
        colour = SEVERITY_COLOUR.get(e["severity"], "#888")
        rows.append(
            f'<tr{cls} data-id="{e.get("id")}"><td>{_rel(e["time"], focus)}</td><td>{escape(_clock(e["time"])[11:])}</td>'
            f'<td class="sev" style="color:{colour}">{escape(e["severity"])}</td><td>{escape(e["kind"])}</td>'
            f'<td>{escape(e["source"])}</td><td>{escape(" ".join(x for x in (e.get("gpu"), e.get("engine")) if x))}</td>'
            f'<td class="msg">{escape(e["message"])}</td></tr>'
        )
    gpus = ", ".join(f"{escape(n)} ({escape(g['bdf'])})" for n, g in sorted(window.gpus.items())) or "none recorded"
    last_samples = []
    for n, g in sorted(window.gpus.items()):
        idx = [i for i, t in enumerate(g["t"]) if t <= focus and g["up"][i]]
        if idx:
            i = idx[-1]
            bits = [f"{g['power_w'][i]:.0f} W" if g["power_w"][i] is not None else None,
                    f"cap {g['cap_w'][i]:.0f} W" if g["cap_w"][i] is not None else None,
                    f"edge {g['edge_c'][i]:.0f} °C" if g["edge_c"][i] is not None else None,
                    f"fan {g['fan_rpm'][i]:.0f} rpm" if g["fan_rpm"][i] is not None else None]
            last_samples.append(f"<li>{escape(n)} at {_rel(g['t'][i], focus)}: {escape(', '.join(b for b in bits if b))}</li>")
    png = f'<p>PNG: <a href="{escape(png_name)}">{escape(png_name)}</a></p>' if png_name else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1"><link rel="icon" href="data:,">
<title>gpuguard report: {escape(title)} at {escape(_clock(focus))}</title><style>{CSS}</style></head>
<body>
<h1 id="headline">{escape(title)} — {escape(_clock(focus))}</h1>
<p class="sub">{escape(context)}</p>
<p class="sub">Window {escape(_clock(window.start))} … {escape(_clock(window.end))} ({window.end - window.start:.0f} s);
GPUs: {gpus}. From {escape(source)}.</p>
<h2>Last sample before it</h2><ul id="last">{''.join(last_samples) or '<li>no GPU sample before it</li>'}</ul>
{render_svg(fig)}
<h2>Kernel lines and gpuguard events</h2>
<table id="events"><thead><tr><th>rel</th><th>time</th><th>severity</th><th>kind</th><th>source</th><th>where</th>
<th>message</th></tr></thead><tbody>{''.join(rows) or '<tr><td colspan="7">no events in this window</td></tr>'}</tbody></table>
{png}
<p class="sub">gpuguard {escape(__version__)} · generated {escape(_clock(time.time()))}</p>
</body></html>
"""
