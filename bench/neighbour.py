"""Benchmark tool (not a test): a busy neighbour on the machine that runs the suite.

What a shared CI machine or a real inference host has beside gpuguard's tests:
  - simulated engines of every kind (`gpuguard.sim.engines`: vLLM with its EngineCore
    child, SGLang, llama-server) serving requests, one restarted every ~20 s;
  - writes to the real /dev/kmsg (where writable): ordinary kernel-looking noise and
    amdgpu lines for a PCI address no test host has, a few per second, in bursts;
  - CPU hogs: `--hogs N` processes spinning (default 1).

    python bench/neighbour.py [--hogs N] [--seconds S]    # until killed by default

bench/soak.sh runs the whole suite several times in a row with this beside it.
"""
from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
DAEMON = os.path.join(HERE, "..", "daemon")
KINDS = ("vllm", "sglang", "llamacpp")
# an address no simulated host uses: a test daemon reading the same /dev/kmsg sees lines
# for a GPU it does not have, as it would on a real host with other cards
FOREIGN = "0000:c1:00.0"
NOISE = (
    "<6>neighbour: usb 1-1: new high-speed USB device number {n} using xhci_hcd",
    "<4>neighbour: EXT4-fs (nvme0n1p2): warning: mounting fs with errors",
    "<6>neighbour: IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready",
    "<3>amdgpu " + FOREIGN + ": amdgpu: ring gfx_0.0.0 timeout, signaled seq={n}, emitted seq={n}9",
    "<4>amdgpu " + FOREIGN + ": amdgpu: [drm] PCIE GART of 512M enabled (table at 0x0000008000F00000).",
    "<6>neighbour: systemd[1]: Started Session {n} of User root.",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hog() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


class Engine:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=DAEMON)
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuguard.sim.engines", "--kind", kind, "--port",
                                      str(self.port), "--slots", "4"], env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)

    def load(self) -> None:
        try:
            httpx.post(f"http://127.0.0.1:{self.port}/sim/requests", json={"count": 2, "max_tokens": 200}, timeout=2)
        except httpx.HTTPError:
            pass  # still starting, or restarting

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def kmsg_writer():
    if not os.access("/dev/kmsg", os.W_OK):
        return None
    n = itertools.count(int(time.time()))

    def write_burst() -> None:
        # a fresh open per burst: the kernel rate-limits each open file of /dev/kmsg
        # (10 lines per 5 s), and a writer that kept one open would mostly be dropped
        try:
            with open("/dev/kmsg", "w") as f:
                for _ in range(random.randint(1, 6)):
                    f.write(random.choice(NOISE).format(n=next(n)) + "\n")
                    f.flush()
        except OSError:
            pass
    return write_burst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hogs", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=0, help="stop after S seconds (0 = until killed)")
    a = ap.parse_args()
    hogs = [multiprocessing.Process(target=hog, daemon=True) for _ in range(a.hogs)]
    for h in hogs:
        h.start()
    engines = [Engine(k) for k in KINDS]
    burst = kmsg_writer()
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    t0 = time.monotonic()
    tick = 0
    print(f"neighbour: {a.hogs} CPU hog(s), engines {', '.join(f'{e.kind}:{e.port}' for e in engines)}, "
          f"/dev/kmsg {'written' if burst else 'not writable: skipped'}", flush=True)
    try:
        while not stop["now"] and (not a.seconds or time.monotonic() - t0 < a.seconds):
            for e in engines:
                e.load()
            if burst is not None:
                burst()
            tick += 1
            if tick % 40 == 0:  # ~20 s: restart one engine
                i = (tick // 40) % len(engines)
                engines[i].stop()
                engines[i] = Engine(engines[i].kind)
            time.sleep(0.5)
    finally:
        for e in engines:
            e.stop()
        for h in hogs:
            h.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
