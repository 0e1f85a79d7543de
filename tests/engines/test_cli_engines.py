"""`gpuguard engines` reads the daemon API: a table (or --json) from real snapshots served
over HTTP, and a clear message (exit 1) when the daemon is not there."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gpuguard.engines.watchdog import EngineWatchdog

from engines_harness import engine_cfg, free_port, sim_env
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "gpuguard", "engines", *args], env=sim_env(),
                          capture_output=True, text=True, timeout=30)


def test_engines_table_and_json_from_daemon_api(sims):
    sim = sims("sglang")
    sim.control("requests", count=2)
    cfg = engine_cfg("qwen", "sglang", sim.url, process={"cmdline": rf"--kind sglang --port {sim.port}( |$)"},
                     poll_interval=0.1)
    wd = EngineWatchdog([cfg], lambda r: None, lambda e: None)

    async def polls():
        for _ in range(40):
            snaps = await wd.poll_once()
            if snaps["qwen"].state == "busy" and snaps["qwen"].tokens_per_second:
                break
            await asyncio.sleep(0.1)
        await wd.aclose()
        return snaps

    snap = asyncio.run(polls())["qwen"]
    assert snap.state == "busy"
    body = json.dumps({"engines": [snap.to_dict()]}).encode()

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            code = 200 if self.path == "/v1/engines" else 404
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", free_port()), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        api = f"http://127.0.0.1:{srv.server_address[1]}"
        out = _cli("--api", api)
        assert out.returncode == 0, out.stderr
        header, row = out.stdout.splitlines()[:2]
        assert header.split()[:4] == ["ENGINE", "KIND", "STATE", "PID"]
        assert row.split()[:6] == ["qwen", "sglang", "busy", str(sim.pid), "2", "0"]
        js = _cli("--api", api, "--json")
        data = json.loads(js.stdout)["engines"][0]
        assert data["name"] == "qwen" and data["pid"] == sim.pid and data["requests_running"] == 2
        assert data["decode_gap_seconds"] is not None  # SGLang separates decode from prefill
    finally:
        srv.shutdown()


def test_engines_says_clearly_when_daemon_unreachable():
    api = f"http://127.0.0.1:{free_port()}"
    out = _cli("--api", api)
    assert out.returncode == 1 and out.stdout == ""
    assert f"not reachable at {api}/v1/engines" in out.stderr and "gpuguard run" in out.stderr
    js = _cli("--api", api, "--json")
    assert js.returncode == 1 and "not reachable" in json.loads(js.stdout)["error"]
