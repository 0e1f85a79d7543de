"""The simulated kernel log reaches a reader as /dev/kmsg records: through a real FIFO,
read by the daemon's own KmsgReader, one record per read (no two records merged), in
order, with the device key and a timestamp of now."""
from __future__ import annotations

import asyncio
import time

from gpuguard.kernel.classify import wall_time_of
from gpuguard.kernel.kmsg import KmsgReader
from gpuguard.sim.kmsg import KERN_ERR, KernelLog
from gpuguard.sim.kmsg_pipe import KmsgPipe


def test_records_arrive_one_by_one_in_order(tmp_path):
    log = KernelLog()
    fifo = str(tmp_path / "kmsg")
    for i in range(40):  # a burst before anyone reads: must not merge in the pipe
        log.dev(KERN_ERR, "amdgpu", "0000:aa:00.0", f"amdgpu: line {i}")
    pipe = KmsgPipe(log, fifo).start()
    try:
        reader = KmsgReader(fifo, state_file=None)

        async def take(n: int) -> list:
            out = []
            async for rec in reader.records():
                out.append(rec)
                if len(out) == n:
                    return out
            return out

        t0 = time.time()
        recs = asyncio.run(asyncio.wait_for(take(40), 60))
    finally:
        pipe.stop()
    assert [r.text for r in recs] == [f"amdgpu 0000:aa:00.0: amdgpu: line {i}" for i in range(40)]
    assert all(r.from_kernel and r.device_bdf == "0000:aa:00.0" for r in recs)
    assert reader.bad_records == 0
    assert all(t0 - 5 <= wall_time_of(r.usec) <= time.time() + 5 for r in recs)
