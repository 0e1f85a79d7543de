"""`gpuguard report` and `gpuguard record` on flight recorders filled by replayed incidents:
INCIDENTS §1 (stall → hang → device lost) and §2 (power climbing to the trip). The report
is read back: every plotted point of the SVG is turned back into a value and checked
against the recorder's rows (read with plain sqlite3), and the PNG's pixels are checked
at the same places."""
from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from gpuguard.report.figure import PALETTE
from gpuguard.report.png import HEADER_H, decode_png
from gpuguard.sim.replay import incident_1, incident_2
from gpuguard.sinks.recorder import FlightRecorder

pytestmark = [pytest.mark.slow]  # registered in pyproject.toml


T0 = 1_790_000_000.0  # a fixed past moment: the files are the same in every run


def gpuguard(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuguard", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.fixture(scope="module")
def recorders(tmp_path_factory):
    d = tmp_path_factory.mktemp("host")
    r1 = incident_1(str(d / "s1" / "flight.sqlite"), T0, FlightRecorder)
    r2 = incident_2(str(d / "s2" / "flight.sqlite"), T0, FlightRecorder)
    # "on another machine": a copy of the file alone, in another folder
    other = tmp_path_factory.mktemp("laptop")
    shutil.copy(r1.path, other / "s1.sqlite")
    shutil.copy(r2.path, other / "s2.sqlite")
    return r1, r2, other


def svg_of(html: str) -> ET.Element:
    m = re.search(r"<svg .*?</svg>", html, re.S)
    assert m, "no inline SVG in the report"
    return ET.fromstring(m.group(0))


def plotted(svg: ET.Element) -> dict[str, list[tuple[float, float, float, float]]]:
    """series name -> [(t, value, x, y)] recovered from the path and its panel's scale."""
    out: dict[str, list] = {}
    ns = "{http://www.w3.org/2000/svg}"
    for g in svg.iter(f"{ns}g"):
        if g.get("class") != "panel":
            continue
        t0, t1, y0, y1 = (float(g.get(k)) for k in ("data-t0", "data-t1", "data-y0", "data-y1"))
        left, top, right, bottom = (float(g.get(k)) for k in ("data-left", "data-top", "data-right", "data-bottom"))
        for p in g.iter(f"{ns}path"):
            pts = []
            for x, y in re.findall(r"[ML]([\d.]+),([\d.]+)", p.get("d")):
                x, y = float(x), float(y)
                pts.append((t0 + (x - left) / (right - left) * (t1 - t0), y0 + (bottom - y) / (bottom - top) * (y1 - y0),
                            x, y))
            out.setdefault(f"{g.get('data-title')}|{p.get('data-name')}", pts)
    return out


def rows(db: str, col: str, gpu: str, start: float, end: float) -> list[tuple[float, float]]:
    with sqlite3.connect(db) as c:
        return c.execute(f"SELECT t, {col} FROM samples WHERE gpu=? AND t BETWEEN ? AND ? AND {col} IS NOT NULL "
                         "ORDER BY t", (gpu, start, end)).fetchall()


def check_series(points, expected, tol_v: float, tol_t: float = 0.3) -> None:
    assert len(points) == len(expected), f"{len(points)} points plotted for {len(expected)} recorder rows"
    for (t, v, _, _), (et, ev) in zip(points, expected):
        assert abs(t - et) <= tol_t, (t, et)
        assert abs(v - ev) <= tol_v, f"plotted {v:.2f} at {t}, recorder has {ev}"


def test_incident_1_report_shows_the_device_loss_and_plots_the_recorder_rows(recorders, tmp_path):
    r1, _, other = recorders
    db = str(other / "s1.sqlite")
    listing = gpuguard("record", "--db", db, "--since", str(T0 - 10), "--until", str(T0 + 1000), "--events", "--json")
    assert listing.returncode == 0, listing.stderr
    events = json.loads(listing.stdout)["events"]
    lost = next(e for e in events if e["kind"] == "device_lost" and e["gpu"] == "xtx-0")
    kinds = [e["kind"] for e in events]
    # the order of §1: the watchdog's alert, sq_intr, device lost, recovery failed
    assert kinds.index("engine_stalled") < kinds.index("sq_interrupt") < kinds.index("device_lost") \
        < kinds.index("gpu_reset_failed")

    out = tmp_path / "s1.html"
    res = gpuguard("report", "--db", db, "--event", str(lost["id"]), "--before", "2m", "--after", "30s", "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert "device_lost" in res.stdout
    html = out.read_text()
    png = (tmp_path / "s1.png").read_bytes()
    # self-contained: nothing fetched from anywhere
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    assert "<script" not in html
    assert "device_lost xtx-0" in html and "device lost from bus!" in html
    assert "GPU Recovery Failed: -19" in html and "sq_intr" in html
    assert 'class="focus"' in html  # the event's row is marked
    # the last telemetry before the loss, as the owner of §1 quoted it (272 W, 56 °C)
    assert re.search(r"xtx-0 at -0\.[0-9] s: 2[67]\d W, cap 355 W, edge 5\d °C", html), html[:3000]

    svg = svg_of(html)
    series = plotted(svg)
    focus, start, end = lost["time"], lost["time"] - 120, lost["time"] + 30
    for gpu in ("xtx-0", "xtx-1"):
        check_series(series[f"{gpu} power|{gpu} power_w"], rows(db, "power_w", gpu, start, end), tol_v=0.5)
        check_series(series[f"{gpu} temperature|{gpu} junction_c"], rows(db, "junction_c", gpu, start, end), tol_v=0.2)
        check_series(series[f"{gpu} fan and busy|{gpu} fan_rpm"], rows(db, "fan_rpm", gpu, start, end), tol_v=5)
        sclk = [(t, v / 1e6) for t, v in rows(db, "sclk_hz", gpu, start, end)]
        check_series(series[f"{gpu} clocks|{gpu} sclk_hz"], sclk, tol_v=10)
        # the GPU stops answering at the loss: no point after it
        assert max(t for t, *_ in series[f"{gpu} power|{gpu} power_w"]) < focus + 0.5
    with sqlite3.connect(db) as c:
        tps = c.execute("SELECT t, tokens_per_s FROM engine_samples WHERE engine='sglang' AND t BETWEEN ? AND ? "
                        "ORDER BY t", (start, end)).fetchall()
    check_series(series["engines tokens/s|sglang tokens_per_s"], tps, tol_v=0.2)
    # every alert-grade kernel line is a marker on the shared time axis
    markers = [m for m in svg.iter("{http://www.w3.org/2000/svg}line") if m.get("class") == "marker"]
    assert {"engine_stalled", "sq_interrupt", "device_lost", "gpu_reset_failed"} <= {m.get("data-kind") for m in markers}

    # the PNG: same figure, same pixel positions (below its title strip)
    w, h, px = decode_png(png)
    assert (w, h) == (int(svg.get("width")), int(svg.get("height")) + HEADER_H)
    colour = bytes(int(PALETTE[0][i:i + 2], 16) for i in (1, 3, 5))
    pts = series["xtx-0 power|xtx-0 power_w"]
    hits = 0
    for _, _, x, y in pts:
        xi, yi = round(x), round(y) + HEADER_H
        near = [px[((yi + dy) * w + xi + dx) * 3:((yi + dy) * w + xi + dx) * 3 + 3] for dx in (-1, 0, 1) for dy in (-1, 0, 1)]
        hits += colour in near
    assert hits >= 0.9 * len(pts), f"only {hits}/{len(pts)} plotted power points have the series colour in the PNG"
    # the focus line: red through the whole height
    fx = round(float(next(l for l in svg.iter("{http://www.w3.org/2000/svg}line") if l.get("class") == "focus").get("x1")))
    assert sum(px[(y * w + fx) * 3] > 150 and px[(y * w + fx) * 3 + 1] < 60 for y in range(HEADER_H, h)) > 0.8 * (h - HEADER_H)


def test_incident_2_report_ends_where_the_recording_stopped(recorders, tmp_path):
    _, r2, other = recorders
    db = str(other / "s2.sqlite")
    out = tmp_path / "trip.html"
    res = gpuguard("report", "--db", db, "--before", "90s", "-o", str(out))  # no event: the last sample
    assert res.returncode == 0, res.stderr
    html = out.read_text()
    assert "recording stopped" in html and "PSU trip" in html
    assert (tmp_path / "trip.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    series = plotted(svg_of(html))
    start, end = r2.focus - 90, r2.focus + 60
    a = rows(db, "power_w", "r9700-a", start, end)
    b = rows(db, "power_w", "r9700-b", start, end)
    check_series(series["r9700-b power|r9700-b power_w"], b, tol_v=0.5)
    # the combined draw the PSU saw: the sum of the two cards' rows at each poll
    total = sorted((t, v + dict(b)[t]) for t, v in a if t in dict(b))
    check_series(series["all GPUs power|total power_w"], total, tol_v=1.0)
    assert total[-1][1] > 500 > total[0][1]  # climbing to the trip
    cap = rows(db, "cap_w", "r9700-a", start, end)
    check_series(series["r9700-a power|r9700-a cap_w"], cap, tol_v=0.5)
    assert re.search(r"r9700-b at [+-]0\.0 s: 2[5-9]\d W, cap 280 W", html)


def test_record_prints_the_recorder_as_table_csv_and_json(recorders):
    _, r2, other = recorders
    db = str(other / "s2.sqlite")
    window = ("--since", str(r2.focus - 10), "--until", str(r2.focus))
    table = gpuguard("record", "--db", db, *window, "--gpu", "r9700-b")
    assert table.returncode == 0, table.stderr
    body = [l for l in table.stdout.splitlines()[2:] if l.strip()]
    assert len(body) == len(rows(db, "power_w", "r9700-b", r2.focus - 10, r2.focus))
    assert all(" r9700-b " in l for l in body)
    as_csv = list(csv.DictReader(io.StringIO(gpuguard("record", "--db", db, *window, "--csv").stdout)))
    assert {r["gpu"] for r in as_csv} == {"r9700-a", "r9700-b"}
    last = [r for r in as_csv if r["gpu"] == "r9700-b"][-1]
    assert float(last["power_w"]) == rows(db, "power_w", "r9700-b", r2.focus - 10, r2.focus)[-1][1]
    doc = json.loads(gpuguard("record", "--db", db, *window, "--json").stdout)
    assert len(doc["samples"]) == len(as_csv)


@pytest.mark.parametrize("setup, expect", [
    ("missing", "not found"),
    ("not-sqlite", "cannot read it as SQLite"),
    ("other-sqlite", "not a gpuguard flight recorder"),
])
def test_report_and_record_name_the_file_when_it_is_not_a_recorder(tmp_path, setup, expect):
    db = tmp_path / "flight.sqlite"
    if setup == "not-sqlite":
        db.write_text("garbage\n" * 100)
    elif setup == "other-sqlite":
        with sqlite3.connect(db) as c:
            c.execute("CREATE TABLE t (x)")
    for cmd in (("report", "-o", str(tmp_path / "r.html")), ("record",)):
        res = gpuguard(*cmd, "--db", str(db))
        assert res.returncode == 1, res
        assert expect in res.stderr and str(db) in res.stderr and "Traceback" not in res.stderr


def test_report_on_an_empty_recorder_says_so(tmp_path):
    FlightRecorder(str(tmp_path / "f.sqlite")).close()
    res = gpuguard("report", "--db", str(tmp_path / "f.sqlite"), "-o", str(tmp_path / "r.html"))
    assert res.returncode == 1 and "empty" in res.stderr


def test_total_power_sums_each_poll_when_every_gpu_is_read_at_its_own_instant():
    """In the daemon each GPU's row carries the time of its own read (a few ms apart within
    a poll): the host total must still be one sum per poll, not one GPU at a time."""
    from gpuguard.report.figure import total_power
    from gpuguard.report.history import Window

    def gpu(offset: float, power: float, lost_after: int | None = None) -> dict:
        t = [1000 + i * 0.5 + offset for i in range(20)]
        p = [None if lost_after is not None and i >= lost_after else power + i for i in range(20)]
        return {"bdf": "x", "t": t, "power_w": p}

    w = Window(1000, 1010, {"a": gpu(0.0, 100), "b": gpu(0.013, 200), "c": gpu(0.021, 50, lost_after=10)}, {}, [])
    ts, totals = total_power(w)
    assert len(ts) == 20
    assert list(totals[:10]) == [350 + 3 * i for i in range(10)]
    assert list(totals[10:]) == [300 + 2 * i for i in range(10, 20)]  # the lost GPU adds nothing


def test_report_at_a_moment_given_as_iso_time(recorders, tmp_path):
    """`--at TIME` from the command line: the owner of §1 knows when the host froze (an ISO
    time from the journal), not an event id. The report centres on that moment, plots the
    recorder's rows of exactly its window and names the event happening there."""
    from datetime import datetime, timezone

    r1, _, other = recorders
    db = str(other / "s1.sqlite")
    with sqlite3.connect(db) as c:
        lost_t, = c.execute("SELECT t FROM events WHERE kind='device_lost' AND gpu='xtx-0' ORDER BY t LIMIT 1").fetchone()
    at = lost_t + 0.4  # "about then", as read off a clock
    iso = datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    out = tmp_path / "at.html"
    res = gpuguard("report", "--db", db, "--at", iso, "--before", "40s", "--after", "10s", "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert "device_lost" in res.stdout, res.stdout  # the most severe event within a second of the moment
    html = out.read_text()
    # both XTX fell off the bus within the second (§1): either loss names the moment, and
    # the report is centred on the time asked, not moved to the event's
    clock = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) + f".{int(at * 10) % 10}"
    assert re.search(rf'<h1 id="headline">device_lost xtx-[01] — {re.escape(clock)}</h1>', html), html[:2000]
    series = plotted(svg_of(html))
    check_series(series["xtx-0 power|xtx-0 power_w"], rows(db, "power_w", "xtx-0", at - 40, at + 10), tol_v=0.5)
    assert (tmp_path / "at.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a quiet moment long before: a report "at" it, with no event to name
    quiet = gpuguard("report", "--db", db, "--at", str(lost_t - 100), "--before", "20s", "--after", "5s",
                     "-o", str(tmp_path / "quiet.html"))
    assert quiet.returncode == 0, quiet.stderr
    assert '<h1 id="headline">moment — ' in (tmp_path / "quiet.html").read_text()

    bad = gpuguard("report", "--db", db, "--at", "yesterday-ish", "-o", str(tmp_path / "bad.html"))
    assert bad.returncode == 2 and "'yesterday-ish' is not a time" in bad.stderr and "Traceback" not in bad.stderr
    both = gpuguard("report", "--db", db, "--at", iso, "--event", "1")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e308", "-5"])
def test_report_at_a_moment_that_is_no_time_says_so_and_exits_2(tmp_path, text):
    # `gpuguard report --at nan` went on to time.localtime and ended in a traceback
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "gpuguard", "report", f"--at={text}", "--db", str(tmp_path / "none.sqlite")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and f"{text!r} is not a time" in r.stderr, r.stderr
