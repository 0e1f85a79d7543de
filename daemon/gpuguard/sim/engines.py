"""Simulated inference engines: a real HTTP server process per engine kind serving that
engine's own /health and /metrics (names, types, labels and HELP as in vLLM 0.33, SGLang
0.5.23, llama-server; reference/engines/ENGINES.md), generating tokens while it has
requests, with the faults gpuguard must catch, on command:

    python -m gpuguard.sim.engines --kind vllm|sglang|llamacpp --port N [options]

Control (POST, JSON body optional):
    /sim/requests {"count":1,"max_tokens":N,"prompt_tokens":P}   add requests (also /v1/completions)
    /v1/completions, /completion with {"stream": true}: one request, its tokens streamed as
                  server-sent events as the core makes them (a client can time every token)
    /sim/stall    the core stops stepping and spins one CPU core; counters freeze
    /sim/unstall  resume
    /sim/slow {"step_time":S}   slower but still progressing
    /sim/hang     every later HTTP connection is accepted and never answered
    /sim/die      exit at once (vLLM: the EngineCore dies, the API server follows in <=5 s)
Signals: SIGUSR1 = stall, SIGUSR2 = hang, SIGTERM = exit (ignored with --ignore-sigterm).

Behaviour per kind while loading (--ready-after S) and when stalled follows ENGINES.md:
vLLM does not answer at all while loading and keeps /health 200 while its EngineCore (a
child process) is hung, /metrics frozen; SGLang answers 503 while starting and /health 503
after --health-check-timeout when its scheduler (a child process) is stuck; llama-server
answers 503 "Loading model" while loading, and /health 200 while /metrics (and /slots, each
slot's n_decoded) blocks when its main loop is wedged. --cache-dir models INCIDENTS §7: zero-byte files there make the
engine exit 0 at "graph capture"; --write-zero-byte-cache N leaves such files and exits.
--prefill-rate R --batch-size B [--starve-decode]: prompts computed B tokens per step at R
tokens/s (a long prompt blocks llama-server's main loop for B/R s; §9 starvation replay)."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from gpuguard.sim.engines_core import Core, run_core_process, serve_fdinfo, set_process_name

KINDS = ("vllm", "sglang", "llamacpp")
CORE_TITLES = {"vllm": "VLLM::EngineCore", "sglang": "sglang::scheduler"}


# -- /metrics rendering, per kind -------------------------------------------------------
def _hist_buckets(h: dict) -> list[tuple[str, float]]:
    out = [(repr(float(b)), float(c)) for b, c in zip(h["bounds"], h["counts"])]
    out.append(("+Inf", float(h["count"])))
    return out


class _Collect:
    def __init__(self, fn) -> None:
        self.collect = fn


def render_vllm(s: dict, model: str) -> bytes:
    lv = ["0", model]
    created = s["started"]

    def collect():
        def gauge(name, doc, value, extra=None):
            g = GaugeMetricFamily(name, doc, labels=["engine", "model_name"] + ([extra[0]] if extra else []))
            if extra:
                for lab, val in extra[1]:
                    g.add_metric(lv + [lab], val)
            else:
                g.add_metric(lv, value)
            return g

        def counter(name, doc, value, extra=None):
            if extra:
                c = CounterMetricFamily(name, doc, labels=["engine", extra[0], "model_name"])
                for lab, val in extra[1]:
                    c.add_metric(["0", lab, model], val, created=created)
            else:
                c = CounterMetricFamily(name, doc, labels=["engine", "model_name"])
                c.add_metric(lv, value, created=created)
            return c

        def hist(name, doc, h):
            m = HistogramMetricFamily(name, doc, labels=["engine", "model_name"])
            m.add_metric(lv, _hist_buckets(h), sum_value=h["sum"])
            m.add_sample(name + "_created", {"engine": "0", "model_name": model}, created)
            return m

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", float(s["running"]))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", float(s["waiting"]))
        w = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all "
            "reasons equals vllm:num_requests_waiting.", labels=["engine", "model_name", "reason"])
        w.add_metric(lv + ["capacity"], float(s["waiting"]))
        w.add_metric(lv + ["deferred"], 0.0)
        yield w
        yield gauge("vllm:engine_sleep_state",
                    "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
                    "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.", None,
                    ("sleep_state", [("discard_all", 0.0), ("weights_offloaded", 0.0), ("awake", 1.0)]))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    min(1.0, s["running"] * 0.015))
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", 0.0)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", float(s["prompt_tokens"]))
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      float(s["generation_tokens"]))
        yield counter("vllm:request_success", "Count of successfully processed requests.", None,
                      ("finished_reason", [(r, float(s["finished"]) if r == "length" else 0.0)
                                           for r in ("stop", "length", "abort", "error", "repetition")]))
        yield hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", s["iteration"])
        yield hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", s["itl"])

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collect(collect))
    return generate_latest(reg)


SGL_SCHED = ["engine_type", "model_name", "moe_ep_rank", "pp_rank", "tp_rank"]


def render_sglang(s: dict, model: str) -> bytes:
    sv = ["unified", model, "0", "0", "0"]

    def collect():
        # MultiProcessCollector: no _created series. Gauges are the logged (lagging) values.
        for name, doc, val in (
            ("sglang:num_running_reqs", "The number of running requests.", s["reported_running"]),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", s["reported_waiting"]),
            ("sglang:gen_throughput", "The generation throughput (token/s).", s["gen_throughput"]),
            ("sglang:token_usage", "The token usage.", round(s["reported_running"] * 0.01, 4)),
        ):
            g = GaugeMetricFamily(name, doc, labels=SGL_SCHED)
            g.add_metric(sv, float(val))
            yield g
        h = HistogramMetricFamily("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                  labels=["engine_type", "model_name"])
        h.add_metric(["unified", model], _hist_buckets(s["itl"]), sum_value=s["itl"]["sum"])
        yield h
        for name, doc, val in (
            ("sglang:prompt_tokens", "Number of prefill tokens processed.", s["finished_prompt_tokens"]),
            ("sglang:generation_tokens", "Number of generation tokens processed.", s["finished_tokens"]),
        ):
            c = CounterMetricFamily(name, doc, labels=["engine_type", "is_streaming", "model_name"])
            c.add_metric(["unified", "true", model], float(val))
            yield c
        rt = CounterMetricFamily(
            "sglang:realtime_tokens",
            "Total number of tokens processed (updated on each log interval). mode: prefill_compute, "
            "prefill_cache, decode.", labels=["engine_type", "mode", "model_name", "moe_ep_rank", "pp_rank", "tp_rank"])
        for mode, val in (("prefill_compute", s["prompt_tokens"]), ("prefill_cache", 0),
                          ("decode", s["generation_tokens"])):
            rt.add_metric(["unified", mode, model, "0", "0", "0"], float(val))
        yield rt

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collect(collect))
    return generate_latest(reg)


LLAMA_FAMILIES = (
    # (name, type, help, state key or callable)
    ("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed, excluding cached tokens",
     "prompt_tokens"),
    ("llamacpp:prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache", lambda s: 0),
    ("llamacpp:prompt_seconds_total", "counter", "Total time spent processing prompts", "prompt_seconds"),
    ("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed", "finished_tokens"),
    ("llamacpp:tokens_predicted_seconds_total", "counter", "Total time spent generating tokens", "finished_seconds"),
    ("llamacpp:n_decode_total", "counter",
     "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding", "steps"),
    ("llamacpp:n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)", "n_tokens_max"),
    ("llamacpp:spec_decode_num_draft_tokens_total", "counter", "Speculative: Total draft tokens generated",
     lambda s: 0),
    ("llamacpp:spec_decode_num_accepted_tokens_total", "counter",
     "Speculative: Total draft tokens accepted by the target model", lambda s: 0),
    ("llamacpp:spec_decode_num_drafts_total", "counter", "Speculative: Total speculative decoding verification steps",
     lambda s: 0),
    ("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s", lambda s: 0),
    ("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s", lambda s: 0),
    ("llamacpp:requests_processing", "gauge", "Number of requests processing", "running"),
    ("llamacpp:requests_deferred", "gauge", "Number of requests deferred", "waiting"),
    ("llamacpp:n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call",
     lambda s: s["busy_slot_steps"] / s["steps"] if s["steps"] else 0),
)


def render_llamacpp(s: dict) -> bytes:
    lines = []
    for name, typ, doc, key in LLAMA_FAMILIES:
        val = key(s) if callable(key) else s[key]
        # std::stringstream, 6 significant digits: a large counter prints as 1.90511e+06
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {typ}", f"{name} {float(val):g}"]
    return ("\n".join(lines) + "\n").encode()


# -- the server ---------------------------------------------------------------------------
class SimEngine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.kind = args.kind
        self.model = args.model or {"vllm": "meta-llama/Llama-3.1-8B-Instruct",
                                    "sglang": "Qwen/Qwen2.5-7B-Instruct", "llamacpp": "gemma-3-270m"}[args.kind]
        self.t0 = time.monotonic()
        self.hang = threading.Event()
        self.never = threading.Event()
        self.state: dict = {}
        self.state_seq = 0
        self.state_cv = threading.Condition()
        self.core_dead = False
        self.core: Core | None = None
        self.child: subprocess.Popen | None = None
        self.request_ids = itertools.count(1)

    @property
    def loading(self) -> bool:
        return time.monotonic() - self.t0 < self.args.ready_after

    # core wiring
    def start_core(self) -> None:
        a = self.args
        if self.kind == "llamacpp":
            self.core = Core(a.step_time, a.slots, prefill_rate=a.prefill_rate, batch=a.batch_size,
                             starve_decode=a.starve_decode)
            if a.drm_root:
                serve_fdinfo(a.drm_root, a.gpu_bdf, a.vram_mib * 1024 * 1024, self.core)
            threading.Thread(target=self.core.loop, kwargs={"on_state": self._on_state}, daemon=True,
                             name="main-loop").start()
            return
        title = CORE_TITLES[self.kind]
        self.child = subprocess.Popen(
            [sys.executable, "-m", "gpuguard.sim.engines", "--core", title, "--kind", self.kind,
             "--step-time", str(a.step_time), "--slots", str(a.slots), "--port", "0",
             "--prefill-rate", str(a.prefill_rate), "--batch-size", str(a.batch_size)]
            + (["--starve-decode"] if a.starve_decode else [])
            + (["--drm-root", a.drm_root, "--gpu-bdf", a.gpu_bdf, "--vram-mib", str(a.vram_mib)] if a.drm_root else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        threading.Thread(target=self._read_child, daemon=True).start()

    def _on_state(self, st: dict) -> None:
        with self.state_cv:
            self.state = st
            self.state_seq += 1
            self.state_cv.notify_all()

    def _read_child(self) -> None:
        assert self.child is not None and self.child.stdout is not None
        for line in self.child.stdout:
            try:
                self._on_state(json.loads(line))
            except ValueError:
                continue
        self.core_dead = True
        if self.kind == "vllm":
            # vLLM watchdog_loop: the API server exits within VLLM_WATCHDOG_TIME_S=5 of EngineDeadError.
            time.sleep(self.args.watchdog_time)
            os._exit(1)

    def command(self, cmd: dict) -> None:
        if self.core is not None:
            self.core.command(cmd)
        elif self.child is not None and self.child.stdin is not None:
            try:
                self.child.stdin.write(json.dumps(cmd) + "\n")
                self.child.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass

    def die(self) -> None:
        if self.child is not None:
            self.child.kill()  # the EngineCore dies; the API server follows (vLLM) or 503s
            if self.kind != "vllm":
                os._exit(1)
            return
        os._exit(1)

    def snapshot_state(self) -> dict:
        with self.state_cv:
            return dict(self.state)


def make_handler(sim: SimEngine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a) -> None:  # quiet
            pass

        def _send(self, code: int, body: bytes | str, ctype: str = "application/json", headers=None) -> None:
            if isinstance(body, str):
                body = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def _refused_without_key(self, path: str) -> bool:
            """--api-key: the API answers 401 to a request without the key, as each engine's
            own check does (vLLM and SGLang guard /v1/*, llama-server all but /health,
            /v1/models and /metrics); /health and /metrics stay open."""
            key = sim.args.api_key
            if not key or path in ("/health", "/v1/health", "/metrics") or path.startswith("/sim/"):
                return False
            if sim.kind == "llamacpp" and path in ("/models", "/v1/models"):
                return False
            if sim.kind != "llamacpp" and not path.startswith("/v1/"):
                return False
            if self.headers.get("Authorization") == f"Bearer {key}":
                return False
            self._send(401, json.dumps({"error": {"code": 401, "message": "Invalid API Key",
                                                  "type": "authentication_error"}}))
            return True

        def _hang_if_told(self) -> None:
            if sim.hang.is_set():
                sim.never.wait()  # accepted, never answered

        def do_GET(self) -> None:  # noqa: N802
            self._hang_if_told()
            path = self.path.split("?")[0]
            if self._refused_without_key(path):
                return
            if path in ("/health", "/v1/health"):
                return self._health()
            if path == "/metrics":
                return self._metrics()
            if path == "/slots" and sim.kind == "llamacpp":
                return self._slots()
            if path in ("/v1/models", "/version", "/props"):
                return self._send(200, json.dumps({"model": sim.model}))
            self._send(404, json.dumps({"error": "not found"}))

        def _health(self) -> None:
            kind = sim.kind
            if kind == "llamacpp":
                if sim.loading:
                    return self._send(503, json.dumps({"error": {"code": 503, "message": "Loading model",
                                                                 "type": "unavailable_error"}}))
                return self._send(200, json.dumps({"status": "ok"}))  # HTTP thread: never the main loop
            if kind == "vllm":
                # AsyncLLM.check_health() only checks `errored`: a hung EngineCore is still 200.
                return self._send(503 if sim.core_dead else 200, b"")
            # SGLang: 503 while starting; otherwise a 1-token probe that must see output
            # from the scheduler after it started, within SGLANG_HEALTH_CHECK_TIMEOUT.
            if sim.loading or sim.core_dead:
                return self._send(503, b"")
            with sim.state_cv:
                tic = sim.state_seq
                ok = sim.state_cv.wait_for(lambda: sim.state_seq > tic, timeout=sim.args.health_check_timeout)
            self._send(200 if ok else 503, b"")

        def _metrics(self) -> None:
            kind = sim.kind
            if kind == "llamacpp":
                if sim.loading:
                    return self._send(503, json.dumps({"error": {"code": 503, "message": "Loading model",
                                                                 "type": "unavailable_error"}}))
                assert sim.core is not None
                # SERVER_TASK_TYPE_METRICS: answered by the main loop, so it blocks when wedged.
                st = sim.core.call_in_loop(sim.core.state)
                return self._send(200, render_llamacpp(st), "text/plain; version=0.0.4",
                                  {"Process-Start-Time-Unix": str(int(st["started"]))})
            if sim.loading:
                return self._send(503, b"")
            st = sim.snapshot_state()
            if not st:
                return self._send(503, b"")
            body = render_vllm(st, sim.model) if kind == "vllm" else render_sglang(st, sim.model)
            self._send(200, body, "text/plain; version=0.0.4; charset=utf-8")

        def _slots(self) -> None:
            if sim.loading:
                return self._send(503, json.dumps({"error": {"code": 503, "message": "Loading model",
                                                             "type": "unavailable_error"}}))
            assert sim.core is not None
            st = sim.core.call_in_loop(sim.core.state)  # a task on the main loop, as /metrics
            out = []
            for slot in st["slots"]:
                row = {"id": slot["id"], "n_ctx": 4096, "speculative": False, "is_processing": slot["is_processing"]}
                if slot["id_task"] is not None:  # server_slot::to_json: task fields once it ran one
                    row.update({"id_task": slot["id_task"], "n_prompt_tokens": slot["n_prompt_tokens"],
                                "next_token": [{"has_next_token": slot["is_processing"], "has_new_line": False,
                                                "n_remain": -1, "n_decoded": slot["n_decoded"]}]})
                out.append(row)
            self._send(200, json.dumps(out))

        def _stream(self, rid: str) -> None:
            """Server-sent events, one per token of request `rid`, as the engine makes them
            (OpenAI completion chunks; llama-server /completion {"content": ...})."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            chunk = (json.dumps({"content": " tok", "stop": False}) if sim.kind == "llamacpp" else
                     json.dumps({"id": rid, "object": "text_completion", "model": sim.model,
                                 "choices": [{"index": 0, "text": " tok", "finish_reason": None}]}))
            sent, seq = 0, -1
            try:
                while True:
                    with sim.state_cv:
                        sim.state_cv.wait_for(lambda: sim.state_seq != seq, timeout=1.0)
                        seq, st = sim.state_seq, sim.state
                    done = rid in st.get("streams_done", {})
                    made = st.get("streams_done", {}).get(rid) if done else st.get("streams", {}).get(rid, 0)
                    if made is None or (not done and rid not in st.get("streams", {}) and sim.core_dead):
                        return
                    if made > sent:
                        self.wfile.write(f"data: {chunk}\n\n".encode() * (made - sent))
                        self.wfile.flush()
                        sent = made
                    if done:
                        self.wfile.write(b"data: [DONE]\n\n")
                        self.wfile.flush()
                        return
            except (BrokenPipeError, ConnectionResetError):
                return  # the client went away

        def do_POST(self) -> None:  # noqa: N802
            self._hang_if_told()
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                return self._send(400, json.dumps({"error": "body is not JSON"}))
            path = self.path.split("?")[0]
            if self._refused_without_key(path):
                return
            if path in ("/sim/requests", "/v1/completions", "/completion"):
                cmd = {"op": "add", "count": int(body.get("count", 1)),
                       "max_tokens": int(body.get("max_tokens", body.get("n_predict", 10**9))),
                       "prompt_tokens": int(body.get("prompt_tokens", 16))}
                if body.get("stream") and path != "/sim/requests":
                    cmd.update(count=1, rid=f"cmpl-{os.getpid()}-{next(sim.request_ids)}")
                    sim.command(cmd)
                    return self._stream(cmd["rid"])
                sim.command(cmd)
                return self._send(200, json.dumps({"queued": cmd["count"]}))
            if path == "/sim/stall":
                sim.command({"op": "stall"})
            elif path == "/sim/unstall":
                sim.command({"op": "unstall"})
            elif path == "/sim/slow":
                sim.command({"op": "step_time", "value": float(body.get("step_time", 1.0))})
            elif path == "/sim/clear":
                sim.command({"op": "clear"})
            elif path == "/sim/hang":
                self._send(200, json.dumps({"ok": "hang"}))
                sim.hang.set()
                return
            elif path == "/sim/die":
                self._send(200, json.dumps({"ok": "die"}))
                self.wfile.flush()
                threading.Thread(target=sim.die, daemon=True).start()
                return
            elif path == "/sim/state":
                return self._send(200, json.dumps(sim.snapshot_state()))
            else:
                return self._send(404, json.dumps({"error": f"unknown control {path}"}))
            self._send(200, json.dumps({"ok": path}))

    return Handler


def _cache_startup(args: argparse.Namespace) -> None:
    """INCIDENTS §7 model: a compile cache with zero-byte files crashes the engine at graph
    capture (exit code 0, nothing in the kernel log); an empty one is compiled and kept."""
    d = Path(args.cache_dir)
    if args.write_zero_byte_cache:
        sub = d / "torch_aot_compile" / "abc123" / "inductor_cache"
        sub.mkdir(parents=True, exist_ok=True)
        for i in range(args.write_zero_byte_cache):
            (sub / (f"k{i}.py" if i % 2 else f"k{i}.best_config")).touch()
        (sub / "compile.lock").touch()
        (d / "index.json").write_text('{"entries": 1}\n')
        sys.exit(0)  # the power loss during the first compile
    broken = [p for p in d.rglob("*") if p.is_file() and p.stat().st_size == 0 and not p.name.endswith(".lock")]
    if broken:
        time.sleep(args.crash_after)
        sys.exit(0)
    sub = d / "torch_aot_compile" / "abc123" / "inductor_cache"
    sub.mkdir(parents=True, exist_ok=True)
    (sub / "k0.py").write_text("# compiled kernel\n")


def serve(args: argparse.Namespace) -> int:
    if args.pid_file:
        Path(args.pid_file).write_text(f"{os.getpid()}\n")
    if args.cache_dir:
        _cache_startup(args)
    set_process_name({"vllm": "vllm-api", "sglang": "sglang-http", "llamacpp": "llama-server"}[args.kind])
    sim = SimEngine(args)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(sim))
    server.daemon_threads = True
    server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def on_term(signum, frame):
        if sim.child is not None:
            sim.child.kill()
        os._exit(0)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_sigterm else on_term)
    signal.signal(signal.SIGUSR1, lambda *_: sim.command({"op": "stall"}))
    signal.signal(signal.SIGUSR2, lambda *_: sim.hang.set())
    sim.start_core()
    if args.kind == "vllm" and args.ready_after > 0:
        # vLLM binds the port first; uvicorn only serves once the engine is ready, so
        # connections wait in the backlog unanswered.
        time.sleep(args.ready_after)
    server.serve_forever(poll_interval=0.05)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpuguard.sim.engines", description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=KINDS, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: open to the LAN)")
    p.add_argument("--api-key", help="the API answers 401 without `Authorization: Bearer KEY` (vLLM/SGLang "
                   "--api-key, llama-server --api-key)")
    p.add_argument("--model")
    p.add_argument("--step-time", type=float, default=0.01, help="seconds per engine step")
    p.add_argument("--slots", type=int, default=4, help="requests running at once; more wait")
    p.add_argument("--ready-after", type=float, default=0.0, help="seconds of model loading before ready")
    p.add_argument("--pid-file")
    p.add_argument("--ignore-sigterm", action="store_true", help="only SIGKILL ends it")
    p.add_argument("--health-check-timeout", type=float, default=20.0, help="SGLang SGLANG_HEALTH_CHECK_TIMEOUT")
    p.add_argument("--watchdog-time", type=float, default=5.0, help="vLLM VLLM_WATCHDOG_TIME_S")
    p.add_argument("--cache-dir", help="compile cache: zero-byte files there crash the start (exit 0)")
    p.add_argument("--crash-after", type=float, default=0.2)
    p.add_argument("--write-zero-byte-cache", type=int, default=0, metavar="N",
                   help="write N zero-byte files into --cache-dir and exit (a power loss mid-compile)")
    p.add_argument("--prefill-rate", type=float, default=0.0,
                   help="prompt tokens/s (CPU-busy); 0 = a prompt takes one ordinary step")
    p.add_argument("--batch-size", "-b", type=int, default=2048,
                   help="prompt tokens per step (llama-server -b, vLLM max-num-batched-tokens, SGLang chunk)")
    p.add_argument("--starve-decode", action="store_true",
                   help="steps carrying prompt tokens carry no decode tokens (INCIDENTS §9)")
    p.add_argument("--drm-root", help="the simulated host's proc tree: the GPU-owning process serves its "
                   "DRM fdinfo there (amdgpu format)")
    p.add_argument("--gpu-bdf", default="0000:03:00.0", help="drm-pdev of the simulated GPU")
    p.add_argument("--vram-mib", type=int, default=1024, help="VRAM the GPU-owning process holds")
    p.add_argument("--core", metavar="TITLE", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.core:
        return run_core_process(args.core, args.step_time, args.slots, args.kind, prefill_rate=args.prefill_rate,
                                batch=args.batch_size, starve_decode=args.starve_decode,
                                drm=(args.drm_root, args.gpu_bdf, args.vram_mib * 1024 * 1024) if args.drm_root else None)
    if args.write_zero_byte_cache and not args.cache_dir:
        print("--write-zero-byte-cache needs --cache-dir", file=sys.stderr)
        return 2
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
