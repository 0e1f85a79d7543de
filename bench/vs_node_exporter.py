"""Benchmark (not a test): gpuguard's cost beside node_exporter's, on the same sysfs tree.

Both run side by side on the simulated host written as a plain tree (4 GPUs: the incident
host; 32 GPUs: bench32), each tree twice: `rest` (every GPU idle, as the simulator starts:
an inference host between requests; gpuguard's power sampler rests at one read a second)
and `mixed` (GPUs at 0, 1/3, 2/3 and full load: the sampler at its full 20 Hz):

  gpuguard       `gpuguard run --sysfs-root TREE` with the default features (1 s poll,
                 20 Hz power sampler, flight recorder, kernel log reader, udev); only the
                 state directory and the listen port are set
  node_exporter  Debian's `prometheus-node-exporter --path.sysfs=TREE/sys
                 --collector.disable-defaults --collector.hwmon --collector.drm`

After a warm-up, an idle phase (nobody scrapes) and a scrape phase (each scraped once a
second, in turn, over one keep-alive connection each, as Prometheus does). Reported per
process: CPU per second in each phase (utime+stime from /proc, which counts whole clock
ticks, and the exact sum of every thread's schedstat run time), context switches per
second (each one a wakeup: on a virtual machine a thread woken from idle costs 100-500 us
before it does anything, so this is the figure that explains the CPU), scrape latency
p50/p99 (client side, request to last byte), body size, RSS at the end and its peak
(VmHWM). For gpuguard, the idle CPU is also broken down by thread (schedstat; named with
`py-spy dump` when py-spy is installed) — the power sampler, the device reader, the
recorder, the event loop. gpuguard runs as installed (bench/processes.installed_env).
`--daemon-dir` runs another checkout's daemon/ (a before/after in one sitting), and the
host's current wakeup cost is printed with the figures: compare runs only beside it.

    python bench/vs_node_exporter.py [--gpus 4 32] [--load rest mixed] [--idle 30] [--scrape 120]
                                     [--json FILE] [--daemon-dir DIR] [--extra-config YAML] [--neighbour]

`--neighbour` keeps a nice-19 spinning process on every CPU throughout: a virtual machine
charges the thread woken on a halted CPU for the CPU's resume (50-80 us a wakeup here,
16-19 us with the CPU busy; a few us on bare metal), which weighs on a process that wakes
20 times a second (the sampler at full rate) far more than on one that wakes per scrape.

Targets: CPU at 1 Hz ≤ 1.5× node_exporter's, scrape p99 ≤ node_exporter's, RSS ≤ 48 MiB.
Run it on a quiet machine: the figures are ratios from one run, but a busy neighbour
stretches wakeups (and so latency) unevenly between a Go and a Python process.
"""
from __future__ import annotations

import argparse
import json
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

NODE_EXPORTER = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
SCENARIO = {4: "incident", 32: "bench32"}
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def switches(pid: int) -> int:
    """Context switches of every thread so far (voluntary + involuntary)."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        n += int(line.split()[1])
        except OSError:
            pass
    return n


def wakeup_cost_us(period: float = 0.05, n: int = 60) -> float:
    """CPU a thread of this machine spends per wakeup from a `period` sleep (with four
    held-file reads, the sampler's work): what this host charges for waking up now."""
    fds = [os.open(__file__, os.O_RDONLY) for _ in range(4)]
    try:
        c0 = time.thread_time()
        for _ in range(n):
            for fd in fds:
                os.pread(fd, 64, 0)
            time.sleep(period)
        return (time.thread_time() - c0) / n * 1e6
    finally:
        for fd in fds:
            os.close(fd)


def thread_cpu(pid: int) -> dict[int, int]:
    """tid -> ns on CPU (schedstat: exact, where /proc stat counts 10 ms ticks)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except OSError:
            pass
    return out


def thread_names(pid: int) -> dict[int, str]:
    if not shutil.which("py-spy"):
        return {}
    try:
        text = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    names = {}
    for line in text.splitlines():
        if line.startswith("Thread "):
            parts = line.split()
            try:
                tid = int(parts[1])
            except ValueError:
                tid = int(parts[1], 16) if parts[1].startswith("0x") else -1
            names[tid] = line.split('"')[1] if '"' in line else parts[1]
    return names


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


LOADS = {
    # every GPU idle, the simulator's own start: an inference host between requests; the
    # power sampler rests (one read a second) once rest_after_seconds have passed
    "rest": lambda i: 0.0,
    # GPUs at 0, 1/3, 2/3 and full load: the sampler at its full 20 Hz
    "mixed": lambda i: (i % 4) / 3,
}


def busy_neighbours() -> list[subprocess.Popen]:
    """One spinning process per CPU at nice 19: it yields to both services at once, but
    keeps every CPU out of its idle halt. On a virtual machine the thread woken on a
    halted CPU is charged the CPU's resume (measured here: a C thread's 50 ms-sleep
    wakeup costs 50-80 us of its own CPU time on an idle VM, 16-19 us with the CPU busy);
    on bare metal that charge is a few microseconds either way."""
    return [subprocess.Popen([sys.executable, "-c", "import os; os.nice(19)\nwhile True: pass"])
            for _ in range(os.cpu_count() or 1)]


def run_one(gpus: int, idle_s: float, scrape_s: float, warm_s: float, daemon_dir: str, extra_config: str,
            load: str = "mixed") -> dict:
    tmp = tempfile.mkdtemp(prefix=f"gpuguard-vs-ne-{gpus}-")
    procs: list[subprocess.Popen] = []
    try:
        host = build_scenario(SCENARIO[gpus])
        for i, bdf in enumerate(host.gpus):
            host.set_load(bdf, LOADS[load](i))
        host.step(2.0)
        tree = os.path.join(tmp, "tree")
        write_tree(host, tree)
        gport, nport = free_port(), free_port()
        cfg = os.path.join(tmp, "gpuguard.yaml")
        with open(cfg, "w") as f:
            # the recorder named too: a daemon from before its path followed state_dir
            f.write(f"state_dir: {tmp}/state\nrecorder: {{path: {tmp}/state/flight.sqlite}}\n"
                    f"listen: {{address: 127.0.0.1, port: {gport}}}\n{extra_config}")
        env = installed_env(daemon_dir)
        gg = subprocess.Popen([sys.executable, "-m", "gpuguard", "run", "--config", cfg, "--sysfs-root", tree],
                              env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "gpuguard.log"), "w"))
        procs.append(gg)
        ne = subprocess.Popen([NODE_EXPORTER, f"--path.sysfs={tree}/sys", "--collector.disable-defaults",
                               "--collector.hwmon", "--collector.drm", f"--web.listen-address=127.0.0.1:{nport}"],
                              stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "node_exporter.log"), "w"))
        procs.append(ne)
        targets = {"gpuguard": (gg, f"http://127.0.0.1:{gport}/metrics"),
                   "node_exporter": (ne, f"http://127.0.0.1:{nport}/metrics")}
        for name, (p, url) in targets.items():
            wait_up(url, p, name)
        time.sleep(warm_s)  # past start-up: discovery, the first PCIe walk, imports

        # idle: nobody scrapes
        c0 = {n: cpu_seconds(p.pid) for n, (p, _) in targets.items()}
        x0 = {n: sum(thread_cpu(p.pid).values()) for n, (p, _) in targets.items()}
        w0 = {n: switches(p.pid) for n, (p, _) in targets.items()}
        t0_threads = thread_cpu(gg.pid)
        t0 = time.monotonic()
        time.sleep(idle_s)
        idle_wall = time.monotonic() - t0
        c1 = {n: cpu_seconds(p.pid) for n, (p, _) in targets.items()}
        x1 = {n: sum(thread_cpu(p.pid).values()) for n, (p, _) in targets.items()}
        w1 = {n: switches(p.pid) for n, (p, _) in targets.items()}
        t1_threads = thread_cpu(gg.pid)
        names = thread_names(gg.pid)
        idle_threads = sorted(((t1_threads[t] - t0_threads.get(t, 0)) / 1e6 / idle_wall, names.get(t, f"thread {t}"))
                              for t in t1_threads)[::-1]

        # scrape: each once a second, in turn
        clients = {n: httpx.Client(timeout=10) for n in targets}
        lat: dict[str, list[float]] = {n: [] for n in targets}
        size: dict[str, int] = {}
        s0 = {n: cpu_seconds(p.pid) for n, (p, _) in targets.items()}
        y0 = {n: sum(thread_cpu(p.pid).values()) for n, (p, _) in targets.items()}
        v0 = {n: switches(p.pid) for n, (p, _) in targets.items()}
        t0 = time.monotonic()
        tick = 0
        while time.monotonic() - t0 < scrape_s:
            order = list(targets) if tick % 2 == 0 else list(targets)[::-1]
            for n in order:
                a = time.perf_counter()
                r = clients[n].get(targets[n][1])
                r.read()
                lat[n].append(time.perf_counter() - a)
                if r.status_code != 200:
                    raise SystemExit(f"{n} answered {r.status_code}")
                size[n] = len(r.content)
            tick += 1
            time.sleep(max(0.0, t0 + tick - time.monotonic()))
        scrape_wall = time.monotonic() - t0
        s1 = {n: cpu_seconds(p.pid) for n, (p, _) in targets.items()}
        y1 = {n: sum(thread_cpu(p.pid).values()) for n, (p, _) in targets.items()}
        v1 = {n: switches(p.pid) for n, (p, _) in targets.items()}
        for c in clients.values():
            c.close()
        out: dict = {"gpus": gpus, "load": load, "idle_seconds": round(idle_wall, 1), "scrape_seconds": round(scrape_wall, 1),
                     "scrapes": tick, "load_before": os.getloadavg()[0]}
        for n, (p, _) in targets.items():
            mem = memory(p.pid)
            out[n] = {
                "idle_cpu_ms_per_s": round((c1[n] - c0[n]) / idle_wall * 1000, 2),
                "scraped_cpu_ms_per_s": round((s1[n] - s0[n]) / scrape_wall * 1000, 2),
                "idle_cpu_exact_ms_per_s": round((x1[n] - x0[n]) / 1e6 / idle_wall, 2),
                "scraped_cpu_exact_ms_per_s": round((y1[n] - y0[n]) / 1e6 / scrape_wall, 2),
                "idle_switches_per_s": round((w1[n] - w0[n]) / idle_wall, 1),
                "scraped_switches_per_s": round((v1[n] - v0[n]) / scrape_wall, 1),
                "scrape_p50_ms": round(pct(lat[n], 0.5) * 1000, 2),
                "scrape_p99_ms": round(pct(lat[n], 0.99) * 1000, 2),
                "body_bytes": size[n],
                "rss_mib": round(mem["VmRSS"], 1),
                "rss_peak_mib": round(mem["VmHWM"], 1),
            }
        g, n_ = out["gpuguard"], out["node_exporter"]
        out["ratio"] = {
            "cpu_scraped": round(g["scraped_cpu_ms_per_s"] / n_["scraped_cpu_ms_per_s"], 2),
            "cpu_scraped_exact": round(g["scraped_cpu_exact_ms_per_s"] / n_["scraped_cpu_exact_ms_per_s"], 2),
            "scrape_p50": round(g["scrape_p50_ms"] / n_["scrape_p50_ms"], 2),
            "scrape_p99": round(g["scrape_p99_ms"] / n_["scrape_p99_ms"], 2),
        }
        out["gpuguard_idle_threads_ms_per_s"] = [(name, round(ms, 2)) for ms, name in idle_threads if ms >= 0.01]
        return out
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[4, 32], choices=sorted(SCENARIO))
    ap.add_argument("--idle", type=float, default=30.0, help="seconds without scrapes")
    ap.add_argument("--scrape", type=float, default=120.0, help="seconds scraped once a second")
    ap.add_argument("--warm", type=float, default=15.0, help="seconds after start before measuring")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--daemon-dir", default=os.path.join(HERE, "..", "daemon"),
                    help="the daemon/ folder to run (another checkout's, for a before/after)")
    ap.add_argument("--extra-config", default="", help="YAML appended to gpuguard's config")
    ap.add_argument("--load", nargs="+", default=["rest", "mixed"], choices=sorted(LOADS),
                    help="rest: every GPU idle; mixed: GPUs at 0, 1/3, 2/3, full load")
    ap.add_argument("--neighbour", action="store_true",
                    help="a nice-19 spinning process per CPU throughout (no CPU halts between wakeups)")
    a = ap.parse_args()
    if not NODE_EXPORTER:
        print("prometheus-node-exporter not found: apt-get install prometheus-node-exporter", file=sys.stderr)
        return 2
    results = []
    neighbours = busy_neighbours() if a.neighbour else []
    try:
        print(f"{os.path.abspath(a.daemon_dir)}; this host's wakeup cost now: {wakeup_cost_us():.0f} us "
              f"per 50 ms sleep (Python, four held-file reads)" + ("; busy neighbours on every CPU" if neighbours else ""))
        for n in a.gpus:
            for load in a.load:
                # past rest_after_seconds (10 s) before measuring, so a resting tree is at rest
                results.append(run_one(n, a.idle, a.scrape, max(a.warm, 12.0) if load == "rest" else a.warm,
                                       a.daemon_dir, a.extra_config, load))
                report(results[-1])
    finally:
        for p in neighbours:
            p.kill()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    ok = all(r["ratio"]["cpu_scraped"] <= 1.5 and r["ratio"]["scrape_p99"] <= 1.0 and r["gpuguard"]["rss_mib"] <= 48
             for r in results)
    return 0 if ok else 1


def report(r: dict) -> None:
    n = r["gpus"]
    g, ne, ratio = r["gpuguard"], r["node_exporter"], r["ratio"]
    print(f"\n{n} GPUs, {r['load']} (load average {r['load_before']:.1f} before; {r['scrapes']} scrapes each)")
    print(f"  {'':14s} {'idle CPU':>10s} {'CPU at 1 Hz':>12s} {'exact':>10s} {'wakeups':>9s} {'p50':>8s} "
          f"{'p99':>8s} {'body':>9s} {'RSS':>8s} {'peak':>8s}")
    for name, m in (("gpuguard", g), ("node_exporter", ne)):
        print(f"  {name:14s} {m['idle_cpu_ms_per_s']:7.2f}ms/s {m['scraped_cpu_ms_per_s']:9.2f}ms/s "
              f"{m['scraped_cpu_exact_ms_per_s']:7.2f}ms/s {m['scraped_switches_per_s']:7.1f}/s "
              f"{m['scrape_p50_ms']:6.2f}ms {m['scrape_p99_ms']:6.2f}ms {m['body_bytes']:8d}B "
              f"{m['rss_mib']:6.1f}Mi {m['rss_peak_mib']:6.1f}Mi")
    print(f"  ratio gpuguard/node_exporter: CPU at 1 Hz {ratio['cpu_scraped']}× (exact {ratio['cpu_scraped_exact']}×), "
          f"p50 {ratio['scrape_p50']}×, p99 {ratio['scrape_p99']}×")
    print("  gpuguard idle CPU by thread: " + ", ".join(f"{name} {ms} ms/s" for name, ms in r["gpuguard_idle_threads_ms_per_s"]))


if __name__ == "__main__":
    sys.exit(main())
