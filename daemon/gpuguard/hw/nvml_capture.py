"""Read-only NVML capture of a real NVIDIA host, idle and under a load, for replay.

    python -m gpuguard.hw.nvml_capture OUTDIR [--load-seconds 30] [--idle-samples 5]

Records every call of gpuguard's call plan (hw/nvml_calls.py) with its answer or NVML
error name and its wall time, once per sample: a few idle samples, then one a second
while a child process runs a bf16 matmul loop on GPU 0 (torch), then a few after. An
event-set waiter records what nvmlEventSetWait answers all the while.

READ-ONLY by construction: it calls only nvmlDeviceGet*/nvmlSystemGet*, the event-set
calls (create/register/wait/free, which change nothing on the card) and nvmlInit/Shutdown.
No power limit, clock, persistence, ECC or MIG setting is touched — the set/reset calls
are refused by `_Recorder` even if a future plan listed one.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

from gpuguard.hw import nvml_calls as plan

READ_ONLY_PREFIXES = ("nvmlDeviceGet", "nvmlSystemGet", "nvmlEventSet", "nvmlDeviceRegisterEvents")

LOAD = r"""
import sys, time, torch
secs = float(sys.argv[1])
a = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
b = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    c = a @ b
torch.cuda.synchronize()
print("ready", flush=True)
t0 = time.time(); n = 0
while time.time() - t0 < secs:
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize(); n += 20
dt = time.time() - t0
print(f"done {n} matmuls in {dt:.1f}s: {n * 2 * 16384**3 / dt / 1e12:.0f} TFLOP/s", flush=True)
"""


def encode(r: Any) -> Any:
    """pynvml answers -> JSON: ctypes structs/unions by field, arrays as lists, pynvml's
    friendly objects by attribute, handles as a marker (they are pointers)."""
    import ctypes

    if isinstance(r, bytes):
        return r.decode(errors="replace")
    if isinstance(r, (bool, int, float, str)) or r is None:
        return r
    if isinstance(r, (list, tuple, ctypes.Array)):
        return [encode(x) for x in r]
    fields = getattr(r, "_fields_", None)
    if fields and not isinstance(r, ctypes._Pointer):
        return {"__struct__": {f[0]: encode(getattr(r, f[0])) for f in fields}}
    if type(r).__name__.endswith("FriendlyObject") or type(r).__name__ == "friendlyObject":
        return {"__struct__": {k: encode(v) for k, v in vars(r).items()}}
    return {"__handle__": True}


def key_args(args: tuple) -> list:
    out: list = []
    for a in args:
        if isinstance(a, (int, str)):
            out.append(a)
        elif isinstance(a, (list, tuple)) and all(isinstance(x, int) for x in a):
            out.append(list(a))
        else:
            out.append("h")
    return out


class _Recorder:
    def __init__(self, nvml: Any) -> None:
        self.n = nvml
        self.calls: list[dict] = []

    def __call__(self, name: str, *args: Any) -> Any:
        if not name.startswith(READ_ONLY_PREFIXES) or name.startswith("nvmlDeviceSet"):
            raise PermissionError(f"capture is read-only; refusing {name}")
        rec: dict = {"call": name, "args": key_args(args)}
        t0 = time.perf_counter_ns()
        try:
            r = getattr(self.n, name)(*args)
        except Exception as e:  # NVMLError_* kept by name for the replay
            rec["ns"] = time.perf_counter_ns() - t0
            rec["error"], rec["message"] = type(e).__name__, str(e)
            self.calls.append(rec)
            return None
        rec["ns"] = time.perf_counter_ns() - t0
        rec["result"] = encode(r)
        self.calls.append(rec)
        return r


def _sample(n: Any, handles: list, phase: str, calls: list) -> dict:
    rec = _Recorder(n)
    t = time.time()
    for i, h in enumerate(handles):
        rec("nvmlDeviceGetHandleByIndex", i)
        for name, args in calls:
            rec(name, h, *args)
    return {"phase": phase, "time": round(t, 3), "calls": rec.calls}


def _events(n: Any, evset: Any, stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        rec = _Recorder(n)
        rec("nvmlEventSetWait_v2", evset, 500)
        c = rec.calls[0]
        c["time"] = round(time.time(), 3)
        out.append(c)
        if "error" in c and c["error"] != "NVMLError_Timeout":
            # not supported here (e.g. in a VM): once is the record; don't spin
            stop.wait(2.0)


def _smi(path: str) -> None:
    try:
        r = subprocess.run(["nvidia-smi", "-q", "-d", "PERFORMANCE,POWER,TEMPERATURE,CLOCK"],
                           capture_output=True, text=True, timeout=30)
        with open(path, "w") as f:
            f.write(r.stdout + r.stderr)
    except Exception as e:
        with open(path, "w") as f:
            f.write(f"nvidia-smi: {e}\n")


def capture(outdir: str, load_seconds: float, idle_samples: int) -> int:
    import pynvml as n

    os.makedirs(outdir, exist_ok=True)
    n.nvmlInit()
    disc = _Recorder(n)
    count = disc("nvmlDeviceGetCount") or 0
    handles = []
    for i in range(count):
        h = disc("nvmlDeviceGetHandleByIndex", i)
        handles.append(h)
        for name, args in plan.discovery_calls():
            disc(name, h, *args)
        for mem in disc("nvmlDeviceGetSupportedMemoryClocks", h) or []:
            disc("nvmlDeviceGetSupportedGraphicsClocks", h, mem)
    meta = {
        "driver_version": encode(disc("nvmlSystemGetDriverVersion")),
        "nvml_version": encode(disc("nvmlSystemGetNVMLVersion")),
        "pynvml": getattr(n, "__version__", None),
        "host": os.uname().nodename,
        "load": f"torch bf16 16384^3 matmul loop, {load_seconds:.0f} s, GPU 0",
    }
    events: list = []
    stop = threading.Event()
    evset = disc("nvmlEventSetCreate")
    waiter = None
    if evset is not None:
        registered = 0
        for h in handles:
            supported = disc("nvmlDeviceGetSupportedEventTypes", h) or 0
            if supported:
                disc("nvmlDeviceRegisterEvents", h, int(supported), evset)
                registered += 0 if disc.calls[-1].get("error") else 1
        if registered:
            waiter = threading.Thread(target=_events, args=(n, evset, stop, events), daemon=True)
            waiter.start()

    calls = plan.poll_calls() + plan.extra_capture_calls()
    samples = []
    for _ in range(idle_samples):
        samples.append(_sample(n, handles, "idle", calls))
        time.sleep(1.0)
    _smi(os.path.join(outdir, "smi-idle.txt"))
    child = subprocess.Popen([sys.executable, "-c", LOAD, str(load_seconds)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    log = [child.stdout.readline()]  # "ready" after the warm-up (or the error)
    t_load = time.time()
    smi_done = False
    while child.poll() is None:
        samples.append(_sample(n, handles, "load", calls))
        if not smi_done and time.time() - t_load > load_seconds / 2:
            _smi(os.path.join(outdir, "smi-load.txt"))
            smi_done = True
        time.sleep(1.0)
    log += child.stdout.readlines()
    for _ in range(3):
        samples.append(_sample(n, handles, "after", calls))
        time.sleep(1.0)
    stop.set()
    if waiter is not None:
        waiter.join(5)
    if evset is not None:
        disc("nvmlEventSetFree", evset)
    n.nvmlShutdown()
    doc = {"meta": meta, "load_log": "".join(log), "discovery": disc.calls, "samples": samples, "events": events}
    # one sample per line: diffable, and a test can replay it byte for byte
    with open(os.path.join(outdir, "nvml-capture.json"), "w") as f:
        f.write("{\n")
        for i, (k, v) in enumerate(doc.items()):
            sep = "," if i < len(doc) - 1 else ""
            if isinstance(v, list):
                f.write(f' "{k}": [\n')
                for j, item in enumerate(v):
                    f.write("  " + json.dumps(item, sort_keys=True) + ("," if j < len(v) - 1 else "") + "\n")
                f.write(f" ]{sep}\n")
            else:
                f.write(f" {json.dumps(k)}: {json.dumps(v, sort_keys=True)}{sep}\n")
        f.write("}\n")
    print("".join(log), end="")
    print(f"{len(samples)} samples, {len(events)} event waits, {len(disc.calls)} discovery calls")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--load-seconds", type=float, default=30.0)
    ap.add_argument("--idle-samples", type=int, default=5)
    a = ap.parse_args(argv)
    return capture(a.outdir, a.load_seconds, a.idle_samples)


if __name__ == "__main__":
    raise SystemExit(main())
