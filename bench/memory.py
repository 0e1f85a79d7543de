"""Benchmark (not a test): resident memory of gpuguard per feature, against the floor of
the libraries it is built on.

  interpreter   `python -c pass`
  stack floor   a FastAPI app with one route served by uvicorn, prometheus_client, pydantic
                and PyYAML imported: the design card's libraries doing nothing
  default       `gpuguard run` on the simulated incident host (4 GPUs, plain tree), default
                features: poller, 20 Hz power sampler, PCIe walk, flight recorder, kernel
                log reader, udev, the API and page
  + scraped     the same after 30 scrapes of /metrics and one of every page/API read route
  + engine      default plus one engine in `engines:` (its probes import httpx)

RSS is VmRSS after start-up settles (and VmHWM, its peak), read from /proc.

    python bench/memory.py [--settle S]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "daemon"))
sys.path.insert(0, HERE)

from gpuguard.sim.runner import build_scenario  # noqa: E402
from gpuguard.sim.tree import write_tree  # noqa: E402
from processes import free_port, memory, wait_up  # noqa: E402

FLOOR_APP = textwrap.dedent("""
    import asyncio, sys
    import yaml, pydantic, prometheus_client, uvicorn
    from fastapi import FastAPI, Response
    app = FastAPI()
    @app.get("/metrics")
    def metrics():
        return Response(prometheus_client.generate_latest())
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", lifespan="off")
""")











def measure(cmd: list[str], url: str | None, settle: float, env: dict | None = None,
            after=None) -> tuple[float, float, tuple[float, float] | None]:
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if url:
            wait_up(url, p)
        time.sleep(settle)
        m = memory(p.pid)
        rss, hwm = m["VmRSS"], m["VmHWM"]
        later = None
        if after is not None:
            after()
            time.sleep(2)
            m = memory(p.pid)
            later = (m["VmRSS"], m["VmHWM"])
        return rss, hwm, later
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settle", type=float, default=15.0)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="gpuguard-memory-")
    rows = []
    try:
        host = build_scenario("incident")
        host.step(2.0)
        tree = os.path.join(tmp, "tree")
        write_tree(host, tree)
        env = dict(os.environ, PYTHONPATH=os.path.join(HERE, "..", "daemon"))
        env.pop("NOTIFY_SOCKET", None)

        rss, hwm, _ = measure([sys.executable, "-c", "import time; time.sleep(60)"], None, 1.0)
        rows.append(("interpreter", rss, hwm))
        port = free_port()
        rss, hwm, _ = measure([sys.executable, "-c", FLOOR_APP, str(port)], f"http://127.0.0.1:{port}/metrics", 2.0)
        rows.append(("stack floor (FastAPI+uvicorn+prometheus_client+pydantic+PyYAML)", rss, hwm))

        def daemon(extra: str, tag: str):
            port = free_port()
            cfg = os.path.join(tmp, f"{tag}.yaml")
            with open(cfg, "w") as f:
                f.write(f"state_dir: {tmp}/state-{tag}\nlisten: {{address: 127.0.0.1, port: {port}}}\n{extra}")
            return ([sys.executable, "-m", "gpuguard", "run", "--config", cfg, "--sysfs-root", tree],
                    f"http://127.0.0.1:{port}")

        cmd, base = daemon("", "default")

        def use() -> None:
            with httpx.Client(base_url=base, timeout=30) as c:
                for _ in range(30):
                    c.get("/metrics")
                for path in ("/", "/v1/status", "/v1/pcie", "/v1/events", "/v1/history?range=600", "/v1/power"):
                    c.get(path)

        rss, hwm, later = measure(cmd, base + "/metrics", a.settle, env, after=use)
        rows.append(("gpuguard, default features", rss, hwm))
        rows.append(("  after 30 scrapes and each page/API read", *later))
        cmd, base = daemon(f"engines:\n  - {{name: e, kind: vllm, url: 'http://127.0.0.1:{free_port()}', process: {{cmdline: 'no-such-engine-xyz'}}}}\n", "engine")
        rss, hwm, _ = measure(cmd, base + "/metrics", a.settle, env)
        rows.append(("gpuguard, default + one engine (httpx)", rss, hwm))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{sys.executable} (Python {sys.version.split()[0]})")
    print(f"{'':66s} {'RSS MiB':>8s} {'peak MiB':>9s}")
    for name, rss, hwm in rows:
        print(f"{name:66s} {rss:8.1f} {hwm:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
