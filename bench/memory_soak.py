"""Benchmark (not a test): does the daemon's memory stay flat on a quiet host?

`gpuguard run` on the simulated incident host (4 GPUs; bench32 with --gpus 32) written as
a plain tree, with the demo's settings (poll every 0.5 s, discovery every 2 s, PCIe walk
every 10 s, the 20 Hz power sampler, the flight recorder, the kernel log), scraped every
5 s as Prometheus would and read every 30 s as a dashboard would (/v1/status,
/v1/events, /v1/history). Its RSS (VmRSS from /proc) is read every 10 s.

The slope is a least-squares line through the samples after the warm-up (the first fifth
of the run, at most 10 minutes: the SQLite page cache, the power sampler's rings and the
event history fill once). Flat: under FLAT_KIB_PER_MIN. The creep this was written for
was 64 KiB/min (60.3 → 63.1 MiB over 10 minutes).

    python bench/memory_soak.py [--minutes 60] [--gpus 4] [--log FILE]

`bench/soak.sh memory [MINUTES]` runs it niced, one line per sample in the log.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "daemon"))
sys.path.insert(0, HERE)

from gpuguard.sim.runner import build_scenario  # noqa: E402
from gpuguard.sim.tree import write_tree  # noqa: E402
from processes import free_port, installed_env, memory, wait_up  # noqa: E402

SCENARIO = {4: "incident", 32: "bench32"}
FLAT_KIB_PER_MIN = 8.0
SAMPLE_S, SCRAPE_S, READ_S = 10.0, 5.0, 30.0
CONFIG = """\
state_dir: {state}
listen: {{address: 127.0.0.1, port: {port}}}
poll: {{interval_seconds: 0.5, discover_seconds: 2.0, pcie_interval_seconds: 10.0}}
recorder: {{path: {state}/flight.sqlite}}
"""


def slope_kib_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) samples, in KiB per minute."""
    n = len(samples)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in samples) / n
    mr = sum(r for _, r in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    cov = sum((t - mt) * (r - mr) for t, r in samples)
    return cov / var * 1024 * 60


def fetch(c: httpx.Client, path: str) -> bool:
    """One request; False when it failed (a loaded machine can time a scrape out: counted,
    the soak goes on)."""
    try:
        return c.get(path).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--gpus", type=int, default=4, choices=sorted(SCENARIO))
    ap.add_argument("--log", default=None, help="one line per RSS sample (default: stdout only)")
    ap.add_argument("--no-reads", action="store_true", help="scrapes only: no dashboard reads (a host nobody looks at)")
    ap.add_argument("--config", default="", help="YAML appended to the daemon's config (e.g. 'recorder: {enabled: false}')")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="gpuguard-soak-")
    log = open(a.log, "a") if a.log else None

    def say(line: str) -> None:
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()

    proc = None
    try:
        host = build_scenario(SCENARIO[a.gpus])
        for i, bdf in enumerate(host.gpus):
            host.set_load(bdf, (i % 4) / 3)
        host.step(2.0)
        write_tree(host, os.path.join(tmp, "root"))
        port = free_port()
        cfg = os.path.join(tmp, "gpuguard.yaml")
        with open(cfg, "w") as f:
            f.write(CONFIG.format(state=os.path.join(tmp, "state"), port=port) + a.config)
        base = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "gpuguard", "run", "--config", cfg, "--sysfs-root",
                                 os.path.join(tmp, "root")], env=installed_env(os.path.join(HERE, "..", "daemon")),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_up(base + "/metrics", proc)
        say(f"soak: gpuguard run, {a.gpus} GPUs (plain tree), {a.minutes:g} min, pid {proc.pid}, "
            f"{sys.executable} (Python {sys.version.split()[0]})")
        t0 = time.monotonic()
        end = t0 + a.minutes * 60
        next_sample = next_scrape = next_read = t0
        samples: list[tuple[float, float]] = []
        failed = 0
        with httpx.Client(base_url=base, timeout=30) as c:
            while True:
                now = time.monotonic()
                if now >= end:
                    break
                if proc.poll() is not None:
                    say(f"soak: the daemon exited {proc.returncode} after {now - t0:.0f} s")
                    return 1
                if now >= next_scrape:
                    failed += not fetch(c, "/metrics")
                    next_scrape += SCRAPE_S
                if now >= next_read and not a.no_reads:
                    for path in ("/v1/status", "/v1/events", "/v1/history?since=0"):
                        failed += not fetch(c, path)
                    next_read += READ_S
                if now >= next_sample:
                    m = memory(proc.pid)
                    rss = m["VmRSS"]
                    samples.append((now - t0, rss))
                    say(f"t={now - t0:7.0f}s rss={rss:7.2f} MiB (anon {m.get('RssAnon', 0):.2f}, file "
                        f"{m.get('RssFile', 0):.2f}, shmem {m.get('RssShmem', 0):.2f})")
                    next_sample += SAMPLE_S
                time.sleep(max(0.0, min(next_sample, next_scrape, next_read, end) - time.monotonic()))
        warm = min(600.0, a.minutes * 60 / 5)
        after = [(t, r) for t, r in samples if t >= warm]
        slope = slope_kib_per_min(after)
        first, last = after[0][1] if after else 0.0, after[-1][1] if after else 0.0
        verdict = "flat" if slope < FLAT_KIB_PER_MIN else "GROWING"
        if failed:
            say(f"soak: {failed} requests failed or timed out (a loaded machine?)")
        say(f"soak: after {warm:.0f} s of warm-up: {first:.2f} → {last:.2f} MiB over {len(after)} samples, "
            f"slope {slope:+.1f} KiB/min: {verdict} (flat is under {FLAT_KIB_PER_MIN:g} KiB/min)")
        return 0 if verdict == "flat" else 1
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if log:
            log.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
