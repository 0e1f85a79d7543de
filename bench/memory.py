"""Benchmark (not a test): resident memory of gpuguard per feature, against the floor of
the libraries it is built on.

  interpreter    `python -c pass`
  stack floor    a FastAPI app with one route served by uvicorn, prometheus_client, pydantic
                 and PyYAML imported: the design card's libraries doing nothing
  reads floor    the same served by Starlette (what gpuguard serves reads with) and no FastAPI
  default        `gpuguard run` on a simulated host (4 GPUs: the incident host; 32: bench32;
                 a plain tree, GPUs under load), default features: poller, 20 Hz power
                 sampler, PCIe walk, flight recorder, kernel log reader, udev, the API and page
  + scraped      then 30 scrapes of /metrics and one of every page/API read route
  + an action    then one request for an action route: the FastAPI control app is built
  + engine       default plus one engine in `engines:` (the watchdog, psutil, httpx)

Each daemon runs as installed (bench/processes.installed_env: bytecode compiled, as pip
leaves it). RSS is VmRSS after start-up settles and after each step (and VmHWM, the peak),
read from /proc.

    python bench/memory.py [--settle S] [--gpus 4 32]
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
from processes import free_port, installed_env, memory, wait_up  # noqa: E402

SCENARIO = {4: "incident", 32: "bench32"}
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
READS_FLOOR_APP = textwrap.dedent("""
    import asyncio, sys
    import yaml, pydantic, prometheus_client, uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route
    async def metrics(request):
        return Response(prometheus_client.generate_latest())
    app = Starlette(routes=[Route("/metrics", metrics)])
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", lifespan="off")
""")


def measure(cmd: list[str], url: str | None, settle: float, env: dict | None = None,
            steps: tuple = ()) -> list[tuple[float, float]]:
    """[(RSS, peak)] after start-up settles, then after each step (a callable)."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if url:
            wait_up(url, p)
        time.sleep(settle)
        out = []
        m = memory(p.pid)
        out.append((m["VmRSS"], m["VmHWM"]))
        for step in steps:
            step()
            time.sleep(2)
            m = memory(p.pid)
            out.append((m["VmRSS"], m["VmHWM"]))
        return out
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def loaded_tree(gpus: int, path: str) -> None:
    host = build_scenario(SCENARIO[gpus])
    for i, bdf in enumerate(host.gpus):
        host.set_load(bdf, (i % 4) / 3)
    host.step(2.0)
    write_tree(host, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settle", type=float, default=15.0)
    ap.add_argument("--gpus", type=int, nargs="+", default=[4, 32], choices=sorted(SCENARIO))
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="gpuguard-memory-")
    rows = []
    try:
        env = installed_env(os.path.join(HERE, "..", "daemon"))
        rows.append(("interpreter", *measure([sys.executable, "-c", "import time; time.sleep(60)"], None, 1.0)[0]))
        for name, app in (("stack floor (FastAPI+uvicorn+prometheus_client+pydantic+PyYAML)", FLOOR_APP),
                          ("reads floor (the same, Starlette instead of FastAPI)", READS_FLOOR_APP)):
            port = free_port()
            rows.append((name, *measure([sys.executable, "-c", app, str(port)], f"http://127.0.0.1:{port}/metrics",
                                        2.0, env)[0]))

        for gpus in a.gpus:
            tree = os.path.join(tmp, f"tree{gpus}")
            loaded_tree(gpus, tree)

            def daemon(extra: str, tag: str):
                port = free_port()
                cfg = os.path.join(tmp, f"{tag}.yaml")
                with open(cfg, "w") as f:
                    f.write(f"state_dir: {tmp}/state-{tag}\nlisten: {{address: 127.0.0.1, port: {port}}}\n{extra}")
                return ([sys.executable, "-m", "gpuguard", "run", "--config", cfg, "--sysfs-root", tree],
                        f"http://127.0.0.1:{port}")

            cmd, base = daemon("", f"default{gpus}")

            def scraped_and_read(base: str = base) -> None:
                with httpx.Client(base_url=base, timeout=30) as c:
                    for _ in range(30):
                        c.get("/metrics")
                    for path in ("/", "/v1/status", "/v1/gpus", "/v1/pcie", "/v1/events", "/v1/history?since=0",
                                 "/v1/power", "/v1/config", "/healthz"):
                        c.get(path)

            def one_action(base: str = base) -> None:
                httpx.post(base + "/v1/gpus/none/reset", json={}, timeout=30)  # 401: no token, the app is built

            start, read, acted = measure(cmd, base + "/metrics", a.settle, env, steps=(scraped_and_read, one_action))
            rows.append((f"gpuguard, {gpus} GPUs, default features", *start))
            rows.append(("  + 30 scrapes and every page/API read", *read))
            rows.append(("  + one action request (the FastAPI control app)", *acted))
            if gpus == a.gpus[0]:
                cmd, base = daemon(f"engines:\n  - {{name: e, kind: vllm, url: 'http://127.0.0.1:{free_port()}', "
                                   "process: {cmdline: 'no-such-engine-xyz'}}\n", f"engine{gpus}")
                rows.append((f"gpuguard, {gpus} GPUs, default + one engine", *measure(cmd, base + "/metrics", a.settle,
                                                                                    env)[0]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{sys.executable} (Python {sys.version.split()[0]})")
    print(f"{'':66s} {'RSS MiB':>8s} {'peak MiB':>9s}")
    for name, rss, hwm in rows:
        print(f"{name:66s} {rss:8.1f} {hwm:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
