"""A Figure as inline SVG. Each plot area carries its scale (`data-t0/t1/y0/y1` and its
box), each line its recorder column (`data-name="xtx-0 power_w"`), so a reader — or a
test — can turn any point back into the value it plots."""
from __future__ import annotations

from html import escape

from gpuguard.report.figure import SEVERITY_COLOUR, Figure


def _path(fig: Figure, i: int, t: tuple, v: tuple) -> str:
    parts = []
    pen_up = True
    for ti, vi in zip(t, v):
        if vi is None:
            pen_up = True
            continue
        parts.append(f"{'M' if pen_up else 'L'}{fig.x(ti):.2f},{fig.y(i, vi):.2f}")
        pen_up = False
    return "".join(parts)


def _num(v: float) -> str:
    return f"{v:g}" if abs(v) < 1e5 else f"{v:.3g}"


def render_svg(fig: Figure) -> str:
    w, h = fig.width, fig.height
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="figure" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
           f'font-family="sans-serif" font-size="11" role="img">']
    ticks = fig.time_ticks()
    for i, p in enumerate(fig.panels):
        left, top, right, bottom = fig.panel_box(i)
        out.append(f'<g class="panel" data-title="{escape(p.title)}" data-t0="{fig.t0!r}" data-t1="{fig.t1!r}" '
                   f'data-y0="{p.y0!r}" data-y1="{p.y1!r}" data-left="{left}" data-top="{top}" data-right="{right}" '
                   f'data-bottom="{bottom}">')
        out.append(f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="#fafafa" '
                   'stroke="#ccc"/>')
        out.append(f'<text x="{left}" y="{top - 6}" font-weight="bold">{escape(p.title)}</text>')
        out.append(f'<text class="unit" x="{left - 6}" y="{top - 6}" text-anchor="end">{escape(p.unit)}</text>')
        for yv in p.ticks():
            y = fig.y(i, yv)
            out.append(f'<line x1="{left}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e4e4e4"/>'
                       f'<text class="ylabel" x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{_num(yv)}</text>')
        for t, label in ticks:
            x = fig.x(t)
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom}" stroke="#eee"/>'
                       f'<text class="xlabel" x="{x:.1f}" y="{bottom + 13}" text-anchor="middle">{escape(label)}</text>')
        for m in fig.markers:
            if fig.t0 <= m.t <= fig.t1:
                x = fig.x(m.t)
                out.append(f'<line class="marker" data-kind="{escape(m.label)}" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" '
                           f'y2="{bottom}" stroke="{SEVERITY_COLOUR.get(m.severity, "#888")}" stroke-width="1" '
                           'stroke-dasharray="3,2"/>')
        lx = left + 120 + 7 * len(p.title)
        for s in p.series:
            d = _path(fig, i, s.t, s.v)
            dash = ' stroke-dasharray="6,3"' if s.dashed else ""
            out.append(f'<path class="series" data-name="{escape(s.name)}" d="{d}" fill="none" stroke="{s.colour}" '
                       f'stroke-width="1.5"{dash}/>')
            out.append(f'<text x="{lx}" y="{top - 6}" fill="{s.colour}">— {escape(s.label)}</text>')
            lx += 14 + 7 * len(s.label) + 10
        out.append("</g>")
    if fig.focus is not None and fig.t0 <= fig.focus <= fig.t1:
        x = fig.x(fig.focus)
        out.append(f'<line class="focus" x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="{h}" stroke="#b00020" stroke-width="2" '
                   'opacity="0.5"/>')
    out.append("</svg>")
    return "".join(out)
