"""How long one PCIe walk takes (the poller runs it on its own slower interval).

    PYTHONPATH=daemon python bench/pcie_walk.py [--sysfs-root DIR | --replay FILE] [-n 50]

Prints the walk's median and worst time and how many GPUs/hops it read."""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from gpuguard.hw.pcie import walk
from gpuguard.hw.pcie_capture import replay
from gpuguard.hw.sysfs import SysfsRoot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sysfs-root", default="/")
    ap.add_argument("--replay", help="a capture file (tests/fixtures/pcie/*.pcie.txt)")
    ap.add_argument("-n", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.replay:
            replay(args.replay, tmp)
            root = SysfsRoot(tmp)
        else:
            root = SysfsRoot(args.sysfs_root)
        times = []
        for _ in range(args.n):
            t0 = time.perf_counter()
            rep = walk(root, select=None)
            times.append(time.perf_counter() - t0)
        every = walk(root, select=lambda *_: True)
    hops = sum(len(g.hops) for g in rep.gpus)
    print(f"walk: {len(rep.gpus)} GPUs, {hops} hops, {len(rep.pairs)} pairs "
          f"(all functions: {len(every.gpus)})")
    print(f"median {statistics.median(times) * 1e3:.2f} ms, worst {max(times) * 1e3:.2f} ms over {args.n} walks")


if __name__ == "__main__":
    main()
