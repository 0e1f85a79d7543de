"""The built-in page in a real headless Chromium (Debian `chromium`, driven by Playwright)
against `gpuguard demo` running as a user runs it: charts render with data and axis
labels, an event injected into the simulated kernel log shows up in the event list with a
link to its report, no request leaves the host, no console error, and the page fits a
phone. A screenshot of each view is written (to $GPUGUARD_SCREENSHOTS when set)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

CHROMIUM = os.environ.get("GPUGUARD_CHROMIUM", "/usr/bin/chromium")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright (python package) not installed")
pytestmark = [
    pytest.mark.slow, pytest.mark.network,  # registered in pyproject.toml
    pytest.mark.skipif(not shutil.which(CHROMIUM) and not os.path.exists(CHROMIUM),
                       reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    port, engine_port = free_port(), free_port()
    sock = str(d / "sim.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuguard", "demo", "--tree", "--port", str(port), "--engine-port", str(engine_port),
         "--control", sock, "--dir", str(d / "host")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=d)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C stops it" in line:
            break
    assert f"page:      http://127.0.0.1:{port}/" in "".join(lines), "".join(lines)
    yield {"base": f"http://127.0.0.1:{port}", "sock": sock, "dir": d}
    proc.send_signal(2)
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def screens(tmp_path_factory) -> Path:
    out = Path(os.environ.get("GPUGUARD_SCREENSHOTS") or tmp_path_factory.mktemp("screens"))
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


class Watch:
    """Every request the page makes and every console message it logs."""

    def __init__(self, page, base: str) -> None:
        self.host = urlparse(base).netloc
        self.requests: list[str] = []
        self.problems: list[str] = []
        page.on("request", lambda r: self.requests.append(r.url))
        page.on("console", lambda m: self.problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        # ERR_ABORTED: a fetch still in flight when the test navigates away, not a page fault
        page.on("requestfailed", lambda r: None if "ERR_ABORTED" in (r.failure or "") else
                self.problems.append(f"request failed: {r.url} {r.failure}"))
        page.on("response", lambda r: self.problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)

    def foreign(self) -> list[str]:
        return [u for u in self.requests if urlparse(u).netloc != self.host and not u.startswith(("data:", "about:"))]


def chart_stats(page) -> dict:
    return page.evaluate("""() => {
      const charts = [...document.querySelectorAll('#view-gpus svg.chart')];
      return {
        charts: charts.length,
        withData: charts.filter(c => [...c.querySelectorAll('path.series')].some(p => +p.dataset.points >= 3 && p.getAttribute('d').length > 20)).length,
        ylabels: charts.filter(c => c.querySelectorAll('text.ylabel').length >= 2).length,
        xlabels: charts.filter(c => c.querySelectorAll('text.xlabel').length >= 1).length,
        titles: charts.map(c => c.dataset.title),
        limits: document.querySelectorAll('#view-gpus svg.chart line.limit').length,
      };
    }""")


def test_page_in_chromium_against_the_demo(demo, browser, screens, wait_for):
    base = demo["base"]
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    watch = Watch(page, base)
    page.goto(base + "/")
    page.wait_for_selector("body[data-loaded]", timeout=30_000)

    # -- charts: every GPU's five charts, each with plotted points and axis labels ---------
    def charted():
        s = chart_stats(page)
        return s if s["charts"] >= 20 and s["withData"] == s["charts"] else None

    stats = wait_for(charted, timeout=60, what="4 GPUs x 5 charts with data", interval=0.5)
    assert stats["ylabels"] == stats["charts"] and stats["xlabels"] == stats["charts"], stats
    assert stats["limits"] >= 4, "temperature charts show the cards' crit limits"
    assert page.locator("article.gpu").count() == 4
    page.screenshot(path=str(screens / "page-gpus.png"))

    # -- events: an injected kernel line reaches the list, with its report ------------------
    page.goto(base + "/#events")
    page.wait_for_selector("#event-table tbody tr")
    before = page.locator('#event-table tr[data-kind="gpu_reset_start"]').count()
    res = subprocess.run([sys.executable, "-m", "gpuguard", "sim", "--control", demo["sock"], "kmsg",
                          "amdgpu 0000:05:00.0: amdgpu: GPU reset begin!", "--gpu", "r9700-a"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    wait_for(lambda: page.locator('#event-table tr[data-kind="gpu_reset_start"]').count() > before, timeout=30,
             what="the injected kernel line in the page's event list", interval=0.3)
    row = page.locator('#event-table tr[data-kind="gpu_reset_start"]').first
    assert "r9700-a" in row.inner_text() and "GPU reset begin!" in row.inner_text()
    href = row.locator("a.report").get_attribute("href")
    assert href and href.startswith("/report?event=")
    page.screenshot(path=str(screens / "page-events.png"))

    # -- engines, PCIe, profiles -------------------------------------------------------
    page.goto(base + "/#engines")
    wait_for(lambda: page.locator('#engine-table tr[data-engine="vllm-demo"]').count() == 1, timeout=30, what="engine row")
    wait_for(lambda: page.locator("#view-engines svg.chart path.series").count() >= 2, timeout=30, what="engine charts")
    page.screenshot(path=str(screens / "page-engines.png"))
    page.goto(base + "/#pcie")
    wait_for(lambda: page.locator("#pcie-box article.pcie").count() == 4, timeout=60, what="PCIe cards", interval=0.5)
    xtx = page.locator('#pcie-box article[data-bdf="0000:aa:00.0"]')
    assert "narrowest hop" in xtx.inner_text() and "DOWNGRADED" in xtx.inner_text()  # INCIDENTS §4
    page.screenshot(path=str(screens / "page-pcie.png"))
    page.goto(base + "/#profiles")
    wait_for(lambda: page.locator("#profile-table tbody tr").count() == 4, timeout=30, what="profile rows")
    page.screenshot(path=str(screens / "page-profiles.png"))

    # -- the report behind the event's link -------------------------------------------
    page.goto(base + href)
    assert "gpu_reset_start r9700-a" in page.locator("#headline").inner_text()
    assert page.locator("svg.figure path.series").count() > 10
    page.screenshot(path=str(screens / "report.png"), full_page=False)

    # -- a phone: nothing wider than the screen ---------------------------------------------
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(base + "/#gpus")
    page.wait_for_selector("body[data-loaded]")
    wait_for(lambda: chart_stats(page)["withData"] >= 20, timeout=30, what="charts on a phone")
    assert page.evaluate("document.documentElement.scrollWidth") <= 391
    page.screenshot(path=str(screens / "page-phone.png"))

    assert watch.foreign() == [], f"requests leaving the host: {watch.foreign()}"
    assert watch.problems == [], watch.problems
    page.close()


def test_actions_need_a_token_and_never_happen_from_a_get(demo):
    base = demo["base"]
    for path in ("/v1/gpus/r9700-a/reset", "/v1/engines/vllm-demo/kill", "/v1/gpus/r9700-a/apply"):
        assert httpx.get(base + path, timeout=10).status_code == 405, path
        assert httpx.post(base + path, json={}, timeout=10).status_code == 401, path
    page = httpx.get(base + "/", timeout=10)
    assert page.status_code == 200
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert httpx.get(base + "/page/../daemon.py", timeout=10).status_code == 404


def test_page_actions_post_only_with_a_token(demo, browser, wait_for):
    """Kill from the page: without a token nothing is sent; with a wrong one the POST is
    refused (401) and the page says so; the engine lives on either way."""
    base = demo["base"]
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    posts: list[str] = []
    page.on("request", lambda r: posts.append(r.url) if r.method == "POST" else None)
    page.on("dialog", lambda d: d.accept())  # the "kill vllm-demo?" confirmation
    page.goto(base + "/#engines")
    page.wait_for_selector('#engine-table button.kill[data-engine="vllm-demo"]', timeout=30_000)
    page.click('#engine-table button.kill[data-engine="vllm-demo"]')
    wait_for(lambda: "type an API token" in page.inner_text("#status"), what="the page asking for a token")
    assert posts == []
    page.click("#tokenbox summary") if not page.locator("#tokenbox[open]").count() else None
    page.fill("#token", "not-a-real-token")
    page.press("#token", "Enter")
    page.click('#engine-table button.kill[data-engine="vllm-demo"]')
    wait_for(lambda: "HTTP 401" in page.inner_text("#status"), what="the refusal shown")
    assert posts == [base + "/v1/engines/vllm-demo/kill"]
    engines = httpx.get(base + "/v1/engines", timeout=10).json()
    assert engines[0]["last_action"] in (None, "") or "kill" not in str(engines[0]["last_action"])
    page.close()


def test_incident_bundles_listed_after_a_stall_and_each_opens_its_report(demo, browser, screens, wait_for):
    """Issue 22 on the page: the stalled engine's bundle appears in the Engines view with its
    engine, time, reason and whether it is complete, and its link renders the bundle. Runs
    last: the stall gets the demo's engine killed."""
    base = demo["base"]
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    watch = Watch(page, base)
    page.goto(base + "/#engines")
    page.wait_for_selector("#incident-table", timeout=30_000)
    assert page.locator("#incident-table tr[data-incident]").count() == 0  # none before the stall
    res = subprocess.run([sys.executable, "-m", "gpuguard", "sim", "--control", demo["sock"], "engine", "stall"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    row = '#incident-table tr[data-incident^="vllm-demo-"]'
    wait_for(lambda: page.locator(row).count() == 1 and "complete" in page.locator(row).inner_text(), timeout=120,
             what="the stall's bundle listed as complete on the page", interval=0.5)
    (bundle,) = httpx.get(base + "/v1/incidents", timeout=10).json()
    cells = page.locator(row).locator("td").all_inner_texts()
    assert cells[0] == "vllm-demo" and cells[2] == bundle["reason"] and cells[3] == "complete", cells
    assert page.locator(row).get_attribute("data-incident") == bundle["name"]
    href = page.locator(row).locator("a.report").get_attribute("href")
    assert href == f"/incident?name={bundle['name']}"
    page.screenshot(path=str(screens / "page-incidents.png"))

    page.goto(base + href)
    assert page.locator("#headline").inner_text().startswith(f"{bundle['reason']} vllm-demo")
    procs = json.loads((Path(bundle["path"]) / "processes.json").read_text())
    section = page.locator(f'section.process[data-pid="{procs[0]["pid"]}"]')
    assert section.locator("td.state").first.inner_text() == procs[0]["state"]
    assert section.locator("td.wchan").first.inner_text() == (procs[0]["wchan"] or "-")
    assert page.locator("svg.figure path.series").count() > 4  # engine readings and the XTX pair's telemetry
    page.screenshot(path=str(screens / "incident-report.png"), full_page=False)
    png = httpx.get(base + f"/incident.png?name={bundle['name']}", timeout=30)
    assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"
    # only a listed bundle renders: a path is never followed
    for name in ("nope", "../" + bundle["name"], bundle["path"]):
        assert httpx.get(base + "/incident", params={"name": name}, timeout=10).status_code == 404, name

    assert watch.foreign() == [], f"requests leaving the host: {watch.foreign()}"
    assert watch.problems == [], watch.problems
    page.close()
