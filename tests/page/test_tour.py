"""The README's five-minute tour, run as written: the command lines are read from the
README's "A five-minute tour" block and run one by one (`gpuguard` as `python -m
gpuguard`, `CMD &` in the background, `kill %1` stops that background job); after each
step the test waits for what the comment promises — by polling, never by sleeping."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


README = Path(__file__).resolve().parents[2] / "README.md"
API = "http://127.0.0.1:9436"


def tour_lines() -> list[str]:
    text = README.read_text()
    m = re.search(r"### A five-minute tour.*?```sh\n(.*?)```", text, re.S)
    assert m, "README has no '### A five-minute tour' sh block"
    lines = []
    for raw in m.group(1).splitlines():
        cmd = raw.split("  #", 1)[0].strip()  # a comment after two spaces
        if cmd and not cmd.startswith("#"):
            lines.append(cmd)
    return lines


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def events() -> list[dict]:
    return httpx.get(f"{API}/v1/events", timeout=5).json()


def test_readme_tour_works_as_written(tmp_path, wait_for, monkeypatch):
    if not port_free(9436):
        pytest.skip("port 9436 is taken (a gpuguard running here?): the tour uses the default port")
    lines = tour_lines()
    assert lines[0].startswith("gpuguard demo") and lines[0].endswith("&") and lines[-1] == "kill %1"
    shutil.rmtree("/tmp/gpuguard-tour", ignore_errors=True)
    # the tour's `gpuguard sim` uses the default control socket: point it at this test's own
    monkeypatch.setenv("GPUGUARD_SIM_SOCKET", str(tmp_path / "sim.sock"))
    background: subprocess.Popen | None = None
    outputs: dict[str, str] = {}

    def argv(cmd: str) -> list[str]:
        words = shlex.split(cmd)
        assert words[0] == "gpuguard", cmd
        return [sys.executable, "-m", "gpuguard", *words[1:]]

    try:
        for cmd in lines:
            if cmd.endswith("&"):
                background = subprocess.Popen(argv(cmd[:-1]), cwd=tmp_path, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True)
                banner = []
                for line in background.stdout:
                    banner.append(line)
                    if "Ctrl-C stops it" in line:
                        break
                assert f"page:      {API}/" in "".join(banner), "".join(banner)
                # "open http://127.0.0.1:9436/": the page and what it reads answer
                page = httpx.get(f"{API}/", timeout=10)
                assert page.status_code == 200 and "/page/page.js" in page.text
                wait_for(lambda: httpx.get(f"{API}/v1/history?since=0", timeout=5).json()["gpus"], timeout=30,
                         what="recorder history behind the page")
                wait_for(lambda: any(e["kind"] == "engine_ready" for e in events()), timeout=60, what="engine ready")
                continue
            if cmd == "kill %1":
                assert background is not None
                background.send_signal(signal.SIGTERM)
                out, _ = background.communicate(timeout=60)
                assert background.returncode == 0, out
                assert "Traceback" not in out
                background = None
                continue
            res = subprocess.run(argv(cmd), cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert res.returncode == 0, f"{cmd}: {res.stderr}"
            outputs[cmd] = res.stdout
            if cmd == "gpuguard sim scenarios":
                assert "incident-chipset" in res.stdout
            elif cmd == "gpuguard sim engine stall":
                wait_for(lambda: any(e["kind"] == "engine_killed" for e in events()), timeout=90,
                         what="the stalled engine killed", interval=0.5)
            elif cmd.startswith("gpuguard sim lose"):
                wait_for(lambda: {"device_lost", "gpu_lost"} <= {e["kind"] for e in events() if e["gpu"] == "xtx-1"},
                         timeout=60, what="xtx-1 lost", interval=0.5)
            elif cmd.startswith("gpuguard events"):
                assert "device_lost" in res.stdout and "xtx-1" in res.stdout
            elif cmd.startswith("gpuguard report"):
                html = (tmp_path / "tour.html").read_text()
                assert "device lost from bus!" in html and "<svg" in html
                assert (tmp_path / "tour.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            elif cmd.startswith("gpuguard record"):
                assert "device_lost" in res.stdout and "engine_killed" in res.stdout
        assert any(c.startswith("gpuguard report") for c in outputs), "the tour reads a report"
    finally:
        if background is not None:
            background.kill()
            background.communicate()
        shutil.rmtree("/tmp/gpuguard-tour", ignore_errors=True)
