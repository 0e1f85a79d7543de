"""GET /v1/history and the bucket cache: what the page charts is what the recorder holds,
averaged per bucket; buckets kept from an earlier request equal a fresh computation after
new rows arrive; no recorder means 501, not an empty chart."""
from __future__ import annotations

import time

import httpx
from fastapi.testclient import TestClient

from gpuguard.sim.replay import incident_1
from gpuguard.sinks.api import build_app
from gpuguard.report.history import FlightLog
from gpuguard.sinks.metrics import MetricsSink
from gpuguard.sinks.page import BucketCache, bucketed, mount_page
from gpuguard.sinks.recorder import FlightRecorder
from gpuguard.state.hub import HostSnapshot, Hub
from gpuguard.state.snapshot import GpuSnapshot


def snap(t: float, power: float) -> HostSnapshot:
    return HostSnapshot(t, (GpuSnapshot(name="g", bdf="0000:05:00.0", vendor="1002", device_id="7551", driver="amdgpu",
                                        model="R9700", card="card1", up=True, time=t, power_watts=power),))


def test_cached_buckets_equal_a_fresh_computation_as_rows_arrive(tmp_path):
    rec = FlightRecorder(str(tmp_path / "f.sqlite"))
    t0 = time.time() - 600
    for i in range(1000):
        last = rec.record(snap(t0 + i * 0.5, 100 + i % 37))
    last.result()  # one writer thread: the last one done means all are
    flight = FlightLog(rec.query, rec.path)
    cache = BucketCache()
    first = bucketed(flight, t0, t0 + 700, 100, None, cache)
    for i in range(1000, 1100):  # new polls after the page loaded
        last = rec.record(snap(t0 + i * 0.5, 300.0))
    last.result()
    later = bucketed(flight, t0, t0 + 700, 100, None, cache)
    fresh = bucketed(flight, t0, t0 + 700, 100, None)
    assert later["gpus"] == fresh["gpus"]
    assert len(later["gpus"]["g"]["t"]) > len(first["gpus"]["g"]["t"])
    # a window that moves on drops what scrolled out of it (a page open for a day)
    moved = bucketed(flight, t0 + 100, t0 + 800, 100, None, cache)
    assert moved["step"] == later["step"]
    kept = cache._entries[("samples", None, later["step"])][2]
    assert kept and min(k for _, k in kept) >= int((t0 + 100) // later["step"])
    # each bucket is the plain average of the recorder's rows in it
    step = fresh["step"]
    rows = rec.query("SELECT t, power_w FROM samples ORDER BY t")
    k = int(rows[-1][0] // step)
    expect = [p for t, p in rows if int(t // step) == k]
    assert abs(fresh["gpus"]["g"]["power_w"][-1] - sum(expect) / len(expect)) < 1e-3
    rec.close()


def test_a_view_whose_window_grows_keeps_one_entry_not_one_per_step_it_passed(tmp_path):
    """A view from the daemon's start (the window grows, so its step does: 2 s, 5 s, 10 s ...)
    left an entry per step it passed, up to 32: after two hours 7 entries, 7.7 times the rows
    the view needed, while a page was open. An entry nobody asked for within a minute goes;
    a page polling its own window keeps its entry all along."""
    rec = FlightRecorder(str(tmp_path / "f.sqlite"))
    now = time.time()
    t0 = now - 7200
    for i in range(0, 7200, 2):
        last = rec.record(snap(t0 + i, 100 + i % 37))
    last.result()
    flight = FlightLog(rec.query, rec.path)
    clock = [0.0]
    cache = BucketCache(clock=lambda: clock[0])
    steps, page_rows = set(), []
    for span in range(60, 7200, 30):  # a request every 30 s, its window from the start
        clock[0] += 30
        view = bucketed(flight, t0, t0 + span, 300, None, cache)
        steps.add(view["step"])
        # a page open on the last 15 minutes of the same history, asking every 2 s meanwhile
        for _ in range(15):
            clock[0] += 2
            page_rows.append(bucketed(flight, t0 + span - 900, t0 + span, 300, None, cache)["step"])
        assert len(cache) <= 4, (span, len(cache))  # this view's and the page's, each for samples and engines
    assert len(steps) >= 6  # the walk went through that many steps
    assert cache.kept_rows() <= len(view["gpus"]["g"]["t"]) + 300, cache.kept_rows()
    assert ("samples", None, page_rows[-1]) in cache._entries  # the page's entry was never dropped
    rec.close()


def test_history_endpoint_serves_the_recorder_and_says_when_there_is_none(tmp_path):
    r = incident_1(str(tmp_path / "f.sqlite"), time.time() - 400, FlightRecorder)
    rec = FlightRecorder(r.path)
    hub = Hub()
    app = build_app(hub, MetricsSink(hub))
    current = {"rec": rec}
    mount_page(app, lambda: current["rec"])
    c = TestClient(app)
    doc = c.get("/v1/history", params={"since": r.focus - 300, "until": r.focus + 100, "points": 1000}).json()
    assert set(doc["gpus"]) == {"xtx-0", "xtx-1"}
    assert "sglang" in doc["engines"]
    assert [e["kind"] for e in doc["events"] if e["severity"] == "critical"][:2] == ["device_lost", "device_lost"]
    assert all(isinstance(e["id"], int) for e in doc["events"])
    # the loss: the last buckets of each GPU read "down"
    assert doc["gpus"]["xtx-0"]["up"][-1] == 0 and doc["gpus"]["xtx-0"]["power_w"][-1] is None
    one = c.get("/v1/history", params={"since": r.focus - 300, "until": r.focus + 100, "gpu": "xtx-1"}).json()
    assert set(one["gpus"]) == {"xtx-1"}
    assert c.get("/v1/history", params={"gpu": "../etc"}).status_code == 422
    assert c.get("/v1/history", params={"since": 10, "until": 5}).status_code == 422
    rep = c.get("/report", params={"event": doc["events"][2]["id"]})
    assert rep.status_code == 200 and "<svg" in rep.text
    import re

    png_link = re.search(r'href="(/report\.png\?[^"]+)"', rep.text).group(1).replace("&amp;", "&")
    assert c.get(png_link).content[:4] == b"\x89PNG"
    assert c.get("/report").status_code == 422
    assert c.get("/report", params={"event": 99999}).status_code == 404
    png = c.get("/report.png", params={"at": r.focus})
    assert png.headers["content-type"] == "image/png" and png.content[:4] == b"\x89PNG"
    current["rec"] = None
    off = c.get("/v1/history")
    assert off.status_code == 501 and "recorder.enabled" in off.json()["detail"]
    rec.close()


def test_page_history_and_reports_follow_the_read_api_rules(tmp_path):
    """Listening beyond loopback without api.open_reads: the page, its assets, history and
    reports need the token like every other read."""
    from gpuguard.control.auth import AccessPolicy, TokenStore

    rec = FlightRecorder(str(tmp_path / "f.sqlite"))
    hub = Hub()
    app = build_app(hub, MetricsSink(hub), tokens=TokenStore({"ops": "s3cret-token-value"}),
                    policy=AccessPolicy("0.0.0.0", False))
    mount_page(app, lambda: rec)
    c = TestClient(app)
    for path in ("/", "/page/page.js", "/v1/history", "/report?at=1"):
        assert c.get(path).status_code == 401, path
    ok = {"Authorization": "Bearer s3cret-token-value"}
    assert c.get("/", headers=ok).status_code == 200
    assert c.get("/page/page.js", headers=ok).headers["content-type"].startswith("text/javascript")
    assert c.get("/v1/history", headers=ok).status_code == 200
    rec.close()


def test_page_assets_are_named_by_content_so_a_reload_fetches_neither(tmp_path):
    """index.html names page.js/page.css with their content hash: that URL may be kept for
    good (a reload on a loaded host skips two requests); any other URL is revalidated, so
    a browser never runs a stale page.js against a newer daemon."""
    import hashlib
    import re
    from importlib import resources

    rec = FlightRecorder(str(tmp_path / "f.sqlite"))
    hub = Hub()
    app = build_app(hub, MetricsSink(hub))
    mount_page(app, lambda: rec)
    c = TestClient(app)
    html = c.get("/").text
    for name in ("page.js", "page.css"):
        body = resources.files("gpuguard.sinks").joinpath("page", name).read_bytes()
        url = re.search(rf'"(/page/{re.escape(name)}\?v=[0-9a-f]+)"', html).group(1)
        assert url.endswith("v=" + hashlib.sha256(body).hexdigest()[:16])
        kept = c.get(url)
        assert kept.content == body and "immutable" in kept.headers["cache-control"]
        assert c.get(f"/page/{name}").headers["cache-control"] == "no-cache"
        assert c.get(f"/page/{name}?v=0123456789abcdef").headers["cache-control"] == "no-cache"
    rec.close()


def test_report_moments_that_are_no_time_are_refused_with_the_reason(tmp_path):
    """`?at=nan`, `inf`, ±1e308 answered 500 (time.localtime raised): 422 naming `at`,
    on the routes that need no token on loopback; history's bounds likewise."""
    r = incident_1(str(tmp_path / "f.sqlite"), time.time() - 400, FlightRecorder)
    rec = FlightRecorder(r.path)
    hub = Hub()
    app = build_app(hub, MetricsSink(hub))
    mount_page(app, lambda: rec)
    c = TestClient(app, raise_server_exceptions=False)
    for bad in ("nan", "inf", "-inf", "1e308", "-1e308"):
        for path in ("/report", "/report.png"):
            got = c.get(path, params={"at": bad})
            assert got.status_code == 422, (path, bad, got.status_code, got.text[:200])
            (detail,) = got.json()["detail"]
            assert detail["loc"] == ["query", "at"] and detail["msg"], (path, bad)
        for key in ("since", "until"):
            got = c.get("/v1/history", params={key: bad})
            assert got.status_code == 422, (key, bad, got.status_code)
            assert got.json()["detail"][0]["loc"] == ["query", key]
    assert c.get("/report", params={"at": r.focus}).status_code == 200  # a real moment still works
    rec.close()
