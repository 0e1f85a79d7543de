"""`gpuguard report --incident` on a real bundle: `gpuguard demo` runs the daemon, its
watchdog and its simulated vLLM; the engine is SIGSTOPped, declared stalled and killed,
and the bundle the daemon wrote (with the flight recorder's GPU telemetry and the kernel
lines of those minutes) is rendered. The report is read back: the stopped process's state
and wchan, the decision's evidence, the kernel line, and every plotted point turned back
into the value the bundle holds."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from html import unescape
from pathlib import Path

import httpx
import pytest

from gpuguard.report.png import HEADER_H, decode_png
from report.test_report import plotted, svg_of

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpuguard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuguard", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def stalled_demo(tmp_path_factory):
    """The demo until its SIGSTOPped engine was killed and the bundle is written."""
    from support import poll_until as wait_for

    d = tmp_path_factory.mktemp("demo")
    port, sock = free_port(), str(d / "sim.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuguard", "demo", "--tree", "--port", str(port), "--engine-port", str(free_port()),
         "--control", sock, "--dir", str(d / "host")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=d)
    base = f"http://127.0.0.1:{port}"
    stopped: list[int] = []
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops it" in line:
                break
        assert "Ctrl-C stops it" in "".join(lines), "".join(lines)

        def decoding():
            (e,) = [x for x in httpx.get(f"{base}/v1/engines", timeout=5).json() if x["name"] == "vllm-demo"]
            return e if e["state"] == "busy" and e["pid"] and e["tokens_per_second"] and e["polls"] >= 7 else None

        engine = wait_for(decoding, timeout=60, what="the demo's vLLM decoding", interval=0.3)
        pid = engine["pid"]
        line = f"INFO: task python3:{pid} blocked for more than 120 seconds."
        res = gpuguard("sim", "--control", sock, "kmsg", line)
        assert res.returncode == 0, res.stderr
        wait_for(lambda: [e for e in httpx.get(f"{base}/v1/events", timeout=5).json() if e["kind"] == "hung_task"],
                 timeout=30, what="the kernel line in the daemon", interval=0.3)
        os.kill(pid, signal.SIGSTOP)  # frozen: nothing moves, /health stops answering
        stopped.append(pid)
        bundles = wait_for(lambda: [b for b in httpx.get(f"{base}/v1/incidents", timeout=5).json()
                                    if "summary.json" in b["files"] and b["engine"] == "vllm-demo"],
                           timeout=90, what="a finished incident bundle", interval=0.5)
        yield {"bundle": bundles[0], "pid": pid, "kernel_line": line, "base": base}
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def test_incident_report_shows_the_frozen_process_the_evidence_and_the_readings(stalled_demo, tmp_path):
    b, pid = stalled_demo["bundle"], stalled_demo["pid"]
    folder = Path(b["path"])
    procs = {p["pid"]: p for p in json.loads((folder / "processes.json").read_text())}
    decision = json.loads((folder / "decision.json").read_text())
    samples = [json.loads(l) for l in (folder / "samples.jsonl").read_text().splitlines()]
    context = json.loads((folder / "context.json").read_text())
    assert procs[pid]["state"] == "T" and procs[pid]["wchan"]  # what the report must show

    # by name under the configured state_dir, as an operator on the host types it
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text(f"state_dir: {folder.parent.parent}\n")
    out = tmp_path / "incident.html"
    res = gpuguard("report", "--incident", folder.name, "--config", str(cfg), "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert f"incident {folder.name}: {decision['reason']} on vllm-demo" in res.stdout
    html = out.read_text()
    png = (tmp_path / "incident.png").read_bytes()
    # self-contained: nothing fetched, no script
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html) and "<script" not in html
    assert f"{decision['reason']} vllm-demo" in html

    # the frozen process: state T and its wchan, as /proc showed them before the kill
    section = re.search(rf'<section class="process" data-pid="{pid}">(.*?)</section>', html, re.S).group(1)
    assert '<td class="state">T</td>' in section
    assert f'<td class="wchan">{procs[pid]["wchan"]}</td>' in section
    assert "Kernel stack" in section and "Threads" in section
    # the decision's evidence, key by key
    evidence = re.search(r'<table id="evidence" class="kv">(.*?)</table>', html, re.S).group(1)
    for key, value in decision["evidence"].items():
        shown = value if isinstance(value, str) else json.dumps(value, default=str)
        assert f"<th>{key}</th>" in evidence and str(shown).replace('"', "&quot;") in evidence, key
    # the kernel line of those minutes
    assert stalled_demo["kernel_line"].split(": ", 1)[-1] in html or "blocked for more than 120 seconds" in html
    # Python stacks, where py-spy could take them
    spy = folder / f"py-spy-{pid}.txt"
    if shutil.which("py-spy"):  # the test extra installs it: CI always has it
        text = spy.read_text()
        assert "Thread" in text and "exited" not in text, text  # read without suspending the frozen process
        shown = re.search(r'<pre class="pyspy">(.*?)</pre>', section, re.S).group(1)
        assert unescape(shown) == text

    # every plotted point is a reading of the bundle
    series = plotted(svg_of(html))
    readings = [s for s in samples if "state" in s and s.get("tokens_per_second") is not None]
    tps = series["engines tokens/s|vllm-demo tokens_per_s"]
    got = [(round(t, 1), v) for t, v, *_ in tps]
    want = [(round(s["t"], 1), s["tokens_per_second"]) for s in readings]
    assert len(got) == len(want) and len(got) >= 5  # >= 7 polls before the freeze, the first without a rate
    for (t, v), (wt, wv) in zip(got, want):
        assert abs(t - wt) <= 0.3 and abs(v - wv) <= max(1.0, 0.01 * wv), (t, v, wt, wv)
    # the step counter climbs until the freeze, then the frozen engine answers nothing: the
    # line stops (a gap, never a repeated last value) before the decision
    steps = series["engine step counter|vllm-demo heartbeat"]
    beats = [(s["t"], s["reading"]["heartbeat"]) for s in samples if "state" in s and s.get("reading")]
    assert len(steps) == len(beats)
    for (t, v, *_), (wt, wv) in zip(steps, beats):
        assert abs(t - wt) <= 0.3 and abs(v - wv) <= max(0.5, 0.005 * wv), (t, v, wt, wv)
    assert steps[-1][1] > steps[0][1]
    silent = [s for s in samples if "state" in s and s["t"] > beats[-1][0]]
    assert silent and all(s["reading"] is None for s in silent) and steps[-1][0] < decision["time"]
    xtx = [(s["t"], s["power_w"]) for s in context["gpu_samples"] if s["gpu"] == "xtx-0" and s["power_w"] is not None]
    power = series["xtx-0 power|xtx-0 power_w"]
    assert len(power) == len(xtx) and len(xtx) >= 3
    for (t, v, *_), (wt, wv) in zip(power, xtx):
        assert abs(t - wt) <= 0.3 and abs(v - wv) <= 0.5, (t, v, wt, wv)

    # the PNG draws the same figure
    w, h, _ = decode_png(png)
    fig_h = int(re.search(r'<svg [^>]*height="(\d+)"', html).group(1))
    assert (w, h) == (960, fig_h + HEADER_H)


def test_a_folder_that_is_not_a_bundle_is_named_not_a_traceback(tmp_path):
    res = gpuguard("report", "--incident", str(tmp_path))
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert f"{tmp_path}: not an incident bundle: decision.json missing" in res.stderr
    (tmp_path / "decision.json").write_text("{")
    (tmp_path / "processes.json").write_text("[]")
    res = gpuguard("report", "--incident", str(tmp_path))
    assert res.returncode == 1 and f"{tmp_path / 'decision.json'}: not JSON" in res.stderr, res.stderr
