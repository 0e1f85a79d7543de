#!/usr/bin/env python3
"""Kernel log burst: does a flood of kernel records block the event loop?

A writer process floods the real /dev/kmsg with N records (half `ring … timeout` hangs,
half benign amdgpu chatter) while gpuguard's KmsgReader + KernelEventRouter consume them
on an asyncio loop that also runs a 10 ms ticker (standing in for the GPU poller). Prints
records/s handled, records lost to ring overwrite (the ring is small: see
`dmesg | grep 'log buffer'`), and how late the ticker woke (p50/p99/max).

Then the same records are replayed in-process (no kernel) to give the CPU cost of
parse + classify + route per record.

    sudo PYTHONPATH=daemon python bench/kmsg_burst.py [-n 10000] [--batch 256]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "daemon"))

from gpuguard.kernel.kmsg import KmsgReader, parse_record  # noqa: E402
from gpuguard.kernel.router import KernelEventRouter  # noqa: E402
from gpuguard.kernel.rules import Rules  # noqa: E402

WRITER = r"""
import os, sys
tag, n = sys.argv[1], int(sys.argv[2])
fd = None
for i in range(n):
    if i % 8 == 0:   # printk_devkmsg=ratelimit: 10 writes per open file per 5 s
        if fd is not None:
            os.close(fd)
        fd = os.open("/dev/kmsg", os.O_WRONLY)
    os.write(fd, (LINE(i) + "\n").encode())
os.close(fd)
"""
LINE = ('lambda i: (f"<7>amdgpu 0000:aa:00.0: ring gfx_0.0.0 timeout, signaled seq={i}, emitted seq={i+1} {tag} {i}"'
        ' if i % 2 else f"<7>amdgpu 0000:aa:00.0: ring gfx_0.0.0 uses VM inv eng 0 on hub 0 {tag} {i}")')


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))] if values else 0.0


async def live(n: int, batch: int) -> None:
    tag = f"kmsgburst-{uuid.uuid4().hex[:8]}"
    reader = KmsgReader(allow_userspace=True, batch=batch)
    router = KernelEventRouter(Rules.load(), gpu_name_for_bdf={"0000:aa:00.0": "gpu-aa"}.get)
    seen = 0
    first = last = 0.0
    finished = asyncio.Event()

    def handle(rec) -> None:
        nonlocal seen, first, last
        if tag not in rec.text:
            return
        now = time.monotonic()
        first = first or now
        last = now
        seen += 1
        router.handle_record(rec)
        if rec.text.endswith(f"{tag} {n - 1}"):
            finished.set()

    late: list[float] = []
    stop = False

    async def ticker() -> None:
        while not stop:
            due = time.monotonic() + 0.01
            await asyncio.sleep(0.01)
            late.append(time.monotonic() - due)

    consume = asyncio.create_task(reader.run(handle))
    tick = asyncio.create_task(ticker())
    while reader.fileno() is None:
        await asyncio.sleep(0.001)
    lost0, over0 = reader.lost_records, reader.overruns
    t0 = time.monotonic()
    code = WRITER.replace("LINE(i)", f"({LINE})(i)")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, tag, str(n))
    await proc.wait()
    t_written = time.monotonic() - t0
    try:
        await asyncio.wait_for(finished.wait(), 30)
    except asyncio.TimeoutError:
        print("the last record never arrived (overwritten?)")
    stop = True
    await tick
    consume.cancel()
    try:
        await consume
    except asyncio.CancelledError:
        pass
    lost = reader.lost_records - lost0
    span = max(last - first, 1e-9)
    print(f"live /dev/kmsg, {n} records, batch {batch}")
    print(f"  writer: {t_written:.3f} s ({n / t_written:,.0f} records/s written)")
    print(f"  handled: {seen} records in {span:.3f} s = {seen / span:,.0f} records/s")
    print(f"  lost to ring overwrite: {lost} records in {reader.overruns - over0} EPIPE overruns "
          f"(handled + lost = {seen + lost})")
    print(f"  classified gpu_hang for gpu-aa: {router.counts[('gpu-aa', 'gpu_hang')]}")
    print(f"  10 ms ticker lateness: p50 {pct(late, .5) * 1e3:.2f} ms, p99 {pct(late, .99) * 1e3:.2f} ms, "
          f"max {max(late) * 1e3:.2f} ms over {len(late)} ticks")


def replay(n: int) -> None:
    rules = Rules.load()
    router = KernelEventRouter(rules, gpu_name_for_bdf={"0000:aa:00.0": "gpu-aa"}.get, max_events=1000)
    raws = []
    for i in range(n):
        text = (f"amdgpu 0000:aa:00.0: ring gfx_0.0.0 timeout, signaled seq={i}, emitted seq={i + 1}"
                if i % 2 else "amdgpu 0000:aa:00.0: ring gfx_0.0.0 uses VM inv eng 0 on hub 0")
        raws.append(f"3,{i},{i},-;{text}\n SUBSYSTEM=pci\n DEVICE=+pci:0000:aa:00.0\n".encode())
    t0 = time.perf_counter()
    for raw in raws:
        parse_record(raw)
    t_parse = time.perf_counter() - t0
    t0 = time.perf_counter()
    for raw in raws:
        router.handle_record(parse_record(raw))
    t_all = time.perf_counter() - t0
    benign = [f"[drm] benign chatter line {i} from some driver with a few words" for i in range(n)]
    t0 = time.perf_counter()
    for text in benign:
        rules.classify(text)
    t_benign = time.perf_counter() - t0
    print(f"in-process replay, {n} records ({len(rules)} rules)")
    print(f"  parse only: {t_parse / n * 1e6:.1f} µs/record")
    print(f"  parse + classify + route (half matching): {t_all / n * 1e6:.1f} µs/record = {n / t_all:,.0f} records/s")
    print(f"  classify benign text: {t_benign / n * 1e6:.1f} µs/record")
    print(f"  load average now: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    if os.geteuid() == 0 and os.access("/dev/kmsg", os.W_OK):
        asyncio.run(live(args.n, args.batch))
    else:
        print("not root or /dev/kmsg not writable: skipping the live flood")
    replay(args.n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
