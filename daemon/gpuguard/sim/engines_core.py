"""The simulated engine core: the batch/step model behind every simulated engine kind
(requests admitted into slots, one prefill step per admission, one decode step per tick
producing one token per running request) and its counters, each credited the way the real
engine credits it (ENGINES.md): per step (vLLM generation tokens, SGLang realtime decode,
llama-server n_decode) or only when a request finishes (SGLang generation_tokens_total,
llama-server tokens_predicted_total). Also the faults that live in the core: stall (the
loop stops stepping and spins one core) and the SGLang gauges that refresh every 40 steps.

It runs as a thread in the server process (llama-server: one process) or as its own child
process speaking JSON lines on stdin/stdout (vLLM EngineCore, SGLang scheduler), so the
GPU-owning process is distinct from the API server, as on a real host.

Prompts (INCIDENTS §9): with a prefill rate set, a prompt is computed in batches of
at most `batch` tokens, one batch per step, each step taking batch tokens / rate seconds of
CPU (as a real prefill computes, or spins on its GPU queue). llama-server batches the busy
slots' decode tokens with the prompt batch (one token each per step, but a long step);
`starve_decode` is the §9 shape: steps that carry prompt tokens carry no decode tokens, so
running requests get nothing until the prompt is done."""
from __future__ import annotations

import ctypes
import json
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
SGLANG_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06,
                      0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)
ITER_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
DECODE_LOG_INTERVAL = 40  # SGLang --decode-log-interval: gauges refresh this often


@dataclass
class Request:
    remaining: int
    prompt: int
    produced: int = 0
    prefilled: bool = False
    prompt_left: int = 0
    rid: str | None = None  # a streamed request: its tokens are counted in state()["streams"]
    slot: int = -1  # the slot it runs in (llama-server /slots)
    task: int = 0


STREAMS_DONE_KEPT = 64  # finished streamed requests whose final count state() still carries


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, v: float, times: int = 1) -> None:
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.counts[i] += times
        self.total += v * times
        self.n += times

    def to_dict(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total, "count": self.n}


class Core:
    def __init__(self, step_time: float = 0.01, slots: int = 4, itl_buckets=ITL_BUCKETS, *,
                 prefill_rate: float = 0.0, batch: int = 2048, starve_decode: bool = False) -> None:
        self.step_time = step_time
        self.slots = slots
        self.prefill_rate = prefill_rate  # tokens/s; 0 = a prompt takes one ordinary step
        self.batch = batch
        self.starve_decode = starve_decode
        self.last_step_seconds = step_time
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.stalled = False
        self.lock = threading.Lock()
        self.tasks: queue.Queue = queue.Queue()  # llama-server: /metrics is a task on the main loop
        self.steps = 0  # engine steps = llama_decode() calls
        self.generation_tokens = 0  # credited every step
        self.prompt_tokens = 0
        self.finished = 0
        self.finished_tokens = 0  # credited at completion
        self.finished_prompt_tokens = 0
        self.finished_seconds = 0.0
        self.prompt_seconds = 0.0
        self.busy_slot_steps = 0
        self.n_tokens_max = 0
        self.iteration = Histogram(ITER_BUCKETS)
        self.itl = Histogram(itl_buckets)
        self.reported_running = 0  # SGLang-style gauges, refreshed on prefill / every 40 steps
        self.reported_waiting = 0
        self.gen_throughput = 0.0
        self._since_log = 0
        self._log_t = time.monotonic()
        self._log_tokens = 0
        self.started = time.time()
        self.beat = 0  # moves every loop turn while the loop is alive (not a metric)
        self.tasks_seen = 0
        self.slot_last: dict[int, Request] = {}  # slot -> its latest request (shown after release too)
        self.streams_done: dict[str, int] = {}

    # commands -----------------------------------------------------------------------
    def add(self, count: int = 1, max_tokens: int = 10**9, prompt_tokens: int = 16, rid: str | None = None) -> None:
        with self.lock:
            for i in range(count):
                self.tasks_seen += 1
                self.waiting.append(Request(remaining=max_tokens, prompt=prompt_tokens, prompt_left=prompt_tokens,
                                            rid=rid if i == 0 else None, task=self.tasks_seen))

    def command(self, cmd: dict) -> None:
        op = cmd.get("op")
        if op == "add":
            self.add(int(cmd.get("count", 1)), int(cmd.get("max_tokens", 10**9)), int(cmd.get("prompt_tokens", 16)),
                     cmd.get("rid"))
        elif op == "stall":
            self.stalled = True
        elif op == "unstall":
            self.stalled = False
        elif op == "step_time":
            self.step_time = float(cmd["value"])
        elif op == "clear":
            with self.lock:
                self.running.clear()
                self.waiting.clear()

    # the loop -----------------------------------------------------------------------
    def step(self) -> bool:
        """One engine iteration; False when there was nothing to do."""
        with self.lock:
            admitted = []
            while self.waiting and len(self.running) < self.slots:
                r = self.waiting.pop(0)
                r.slot = min(set(range(self.slots)) - {x.slot for x in self.running})
                self.slot_last[r.slot] = r
                self.running.append(r)
                admitted.append(r)
            if not self.running:
                if self.reported_running or self.reported_waiting:  # SGLang idle reset
                    self.reported_running = self.reported_waiting = 0
                    self.gen_throughput = 0.0
                return False
            self.steps += 1
            tokens_this_step = 0
            prompt_now = 0
            if self.prefill_rate > 0:
                # one batch of prompt tokens, across the requests still in their prompt
                budget = self.batch
                filling = [r for r in self.running if r.prompt_left > 0]
                for r in filling:
                    take = min(budget, r.prompt_left)
                    r.prompt_left -= take
                    budget -= take
                    prompt_now += take
                    if r.prompt_left == 0:
                        r.prefilled = True
                    if budget <= 0:
                        break
                decoding = [r for r in self.running if r.prompt_left == 0 and r not in filling]
                if prompt_now:
                    self.prompt_tokens += prompt_now
                    tokens_this_step += prompt_now
                    self.prompt_seconds += prompt_now / self.prefill_rate
                    self.reported_running, self.reported_waiting = len(self.running), len(self.waiting)
                    if self.starve_decode:
                        decoding = []
                self.last_step_seconds = self.step_time + prompt_now / self.prefill_rate
            else:
                if admitted:  # a prefill step (chunked prefill still steps)
                    for r in admitted:
                        self.prompt_tokens += r.prompt
                        tokens_this_step += r.prompt
                        r.prefilled = True
                        r.prompt_left = 0
                    self.prompt_seconds += self.step_time
                    self.reported_running, self.reported_waiting = len(self.running), len(self.waiting)
                decoding = [r for r in self.running if r not in admitted]
                self.last_step_seconds = self.step_time
            for r in decoding:
                r.produced += 1
                r.remaining -= 1
                self.n_tokens_max = max(self.n_tokens_max, r.prompt + r.produced)
            n = len(decoding)
            self.generation_tokens += n
            tokens_this_step += n
            self.busy_slot_steps += len(self.running)
            self.iteration.observe(float(tokens_this_step))
            if n:
                self.itl.observe(self.step_time, n)
            done = [r for r in self.running if r.remaining <= 0]
            for r in done:
                self.running.remove(r)
                self.finished += 1
                self.finished_tokens += r.produced
                self.finished_prompt_tokens += r.prompt
                self.finished_seconds += r.produced * self.step_time
                if r.rid is not None:
                    self.streams_done[r.rid] = r.produced
                    while len(self.streams_done) > STREAMS_DONE_KEPT:
                        self.streams_done.pop(next(iter(self.streams_done)))
            self._since_log += 1
            if self._since_log >= DECODE_LOG_INTERVAL:
                now = time.monotonic()
                self.gen_throughput = (self.generation_tokens - self._log_tokens) / max(now - self._log_t, 1e-6)
                self._log_t, self._log_tokens, self._since_log = now, self.generation_tokens, 0
                self.reported_running, self.reported_waiting = len(self.running), len(self.waiting)
            return True

    def loop(self, on_state=None, stop: threading.Event | None = None) -> None:
        last_emit = 0.0
        while stop is None or not stop.is_set():
            if self.stalled:
                # INCIDENTS §1: spin-waiting on a hung queue — 100 % of one core, no progress,
                # nothing else served (llama-server's /metrics task waits forever).
                x = 0
                while self.stalled:
                    x += 1
                continue
            self.beat += 1
            while True:
                try:
                    fn, box, done = self.tasks.get_nowait()
                except queue.Empty:
                    break
                box.append(fn())
                done.set()
            worked = self.step()
            now = time.monotonic()
            if on_state is not None and (worked or now - last_emit >= 0.05):
                on_state(self.state())
                last_emit = now
            if worked and self.last_step_seconds > self.step_time:
                # a prompt batch computes: CPU busy for its whole length, nothing else served
                end = now + self.last_step_seconds
                while time.monotonic() < end:
                    pass
            else:
                time.sleep(self.step_time if worked else min(self.step_time, 0.01))

    def call_in_loop(self, fn, timeout: float | None = None):
        """Run fn on the main loop and wait for it (blocks while the loop is wedged)."""
        box: list = []
        done = threading.Event()
        self.tasks.put((fn, box, done))
        if not done.wait(timeout):
            raise TimeoutError
        return box[0]

    def state(self) -> dict:
        with self.lock:
            return {
                "running": len(self.running), "waiting": len(self.waiting),
                "reported_running": self.reported_running, "reported_waiting": self.reported_waiting,
                "gen_throughput": self.gen_throughput,
                "steps": self.steps, "generation_tokens": self.generation_tokens,
                "prompt_tokens": self.prompt_tokens, "finished": self.finished,
                "finished_tokens": self.finished_tokens, "finished_prompt_tokens": self.finished_prompt_tokens,
                "finished_seconds": self.finished_seconds, "prompt_seconds": self.prompt_seconds,
                "busy_slot_steps": self.busy_slot_steps, "n_tokens_max": self.n_tokens_max,
                "iteration": self.iteration.to_dict(), "itl": self.itl.to_dict(),
                "started": self.started, "beat": self.beat, "time": time.time(),
                "streams": {r.rid: r.produced for r in self.running + self.waiting if r.rid is not None},
                "streams_done": dict(self.streams_done),
                # llama-server /slots: each slot's latest request, n_decoded = its tokens so far
                "slots": [{"id": i, "is_processing": any(r.slot == i for r in self.running),
                           "id_task": self.slot_last[i].task if i in self.slot_last else None,
                           "n_prompt_tokens": self.slot_last[i].prompt if i in self.slot_last else None,
                           "n_decoded": self.slot_last[i].produced if i in self.slot_last else None}
                          for i in range(self.slots)],
            }


def fdinfo_text(bdf: str, client_id: int, vram: int, busy_ns: int) -> str:
    """What amdgpu's show_fdinfo prints for one DRM file (drm core keys, then amdgpu's
    legacy drm-memory-* in KiB, its amd-* keys, and drm-engine-* busy time in ns)."""
    kib = vram // 1024
    return (f"pos:\t0\nflags:\t02100002\nmnt_id:\t26\nino:\t1045\n"
            f"drm-driver:\tamdgpu\ndrm-client-id:\t{client_id}\ndrm-pdev:\t{bdf}\npasid:\t32770\n"
            f"drm-memory-vram:\t{kib} KiB\ndrm-memory-gtt: \t2048 KiB\ndrm-memory-cpu: \t0 KiB\n"
            f"amd-memory-visible-vram:\t{kib} KiB\namd-evicted-vram:\t0 KiB\namd-evicted-visible-vram:\t0 KiB\n"
            f"amd-requested-vram:\t{kib} KiB\namd-requested-visible-vram:\t0 KiB\namd-requested-gtt:\t2048 KiB\n"
            f"drm-engine-gfx:\t{busy_ns} ns\ndrm-engine-compute:\t{busy_ns // 2} ns\n")


def serve_fdinfo(root: str, bdf: str, vram: int, core: "Core", stop: threading.Event | None = None) -> None:
    """The simulated host's /proc for this process: <root>/<pid>/{comm,fd/N,fdinfo/N}, an
    open render node (two fds on one DRM client, as after a dup) whose busy time grows with
    the engine's steps. Runs as a daemon thread of the GPU-owning process."""
    import os
    from pathlib import Path

    base = Path(root) / str(os.getpid())
    (base / "fd").mkdir(parents=True, exist_ok=True)
    (base / "fdinfo").mkdir(exist_ok=True)
    comm = Path(f"/proc/{os.getpid()}/comm").read_text()
    (base / "comm").write_text(comm)
    client = 40 + os.getpid() % 1000
    for fd in ("7", "8"):
        link = base / "fd" / fd
        if not link.is_symlink():
            link.symlink_to("/dev/dri/renderD128")

    def loop() -> None:
        while stop is None or not stop.is_set():
            text = fdinfo_text(bdf, client, vram, core.steps * int(core.step_time * 1e9))
            for fd in ("7", "8"):
                tmp = base / "fdinfo" / f".{fd}.tmp"
                tmp.write_text(text)
                tmp.replace(base / "fdinfo" / fd)
            time.sleep(0.2)

    threading.Thread(target=loop, daemon=True, name="fdinfo").start()


def set_process_name(name: str) -> None:
    """Like setproctitle in vLLM/SGLang: the comm (15 chars) names the engine core."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except OSError:
        pass


def run_core_process(title: str, step_time: float, slots: int, itl: str, drm: tuple | None = None,
                     **prefill) -> int:
    """Child-process mode: commands in on stdin, state out on stdout, one JSON per line."""
    set_process_name(title)
    core = Core(step_time, slots, SGLANG_ITL_BUCKETS if itl == "sglang" else ITL_BUCKETS, **prefill)
    if drm:
        serve_fdinfo(drm[0], drm[1], drm[2], core)
    out_lock = threading.Lock()

    def emit(state: dict) -> None:
        with out_lock:
            try:
                sys.stdout.write(json.dumps(state) + "\n")
                sys.stdout.flush()
            except (BrokenPipeError, ValueError):
                raise SystemExit(0)  # the API server is gone: so is the engine core

    def commands() -> None:
        for line in sys.stdin:
            try:
                core.command(json.loads(line))
            except (ValueError, KeyError):
                continue
        # stdin closed: the API server exited; a real EngineCore dies with it.
        import os
        os._exit(0)

    threading.Thread(target=commands, daemon=True).start()
    core.loop(on_state=emit)
    return 0
