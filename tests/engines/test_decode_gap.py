"""The decode gap against the truth (INCIDENTS §9: users want the longest no-token gap of
running requests as a number). The gauge runs from the last poll that saw decode progress to
the first poll that saw it resume, so the true gap lies within one poll interval of it; for
llama-server decode progress is its slots' generated tokens (/slots n_decoded), never
n_decode_total, which also counts decode calls that carry only prompt tokens.

Ground truth: a streaming client timestamps every token of a running request while a long
prompt arrives beside it, against real simulated engine processes and the real watchdog loop."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from gpuguard.engines.adapters import EngineReading, slots_decoded
from gpuguard.engines.adapters import Adapter
from gpuguard.engines.exposition import Samples
from gpuguard.engines.stall import Observation as O, StallSettings, StallTracker
from gpuguard.engines.watchdog import EngineWatchdog

from engines_harness import engine_cfg, run_watchdog_until


def R(running=1, decode=0.0, hb=0.0):
    return EngineReading(running, 0, hb, hb, decode, None, None, hb)


def test_gap_runs_from_the_last_poll_that_saw_decode_to_the_first_that_saw_it_resume():
    """Polls every 1 s; decode seen moving at 1.0, flat at 2-5, moving again at 6.0. The last
    token before the gap came in (0, 1], the first after it in (5, 6]: the gap lies in (4, 6),
    and 5.0 is within one poll of every value there (4.0, what was read before, is not)."""
    tr = StallTracker(StallSettings(stall_after=600.0), separates_decode=True)
    tr.observe(O(0.0, 7, None, "ready", R(decode=0, hb=0)))
    tr.observe(O(1.0, 7, None, "ready", R(decode=1, hb=1)))
    for t in (2.0, 3.0, 4.0, 5.0):  # steps go on (prompt batches), decode does not
        v = tr.observe(O(t, 7, None, "ready", R(decode=1, hb=t)))
    assert v.decode_gap_seconds == 4.0  # still open: the time since decode was last seen moving
    v = tr.observe(O(6.0, 7, None, "ready", R(decode=2, hb=6)))
    assert v.decode_gap_seconds == 5.0
    v = tr.observe(O(7.0, 7, None, "ready", R(decode=3, hb=7)))
    assert v.decode_gap_seconds == 5.0  # the longest in the window, after it closed


def test_gap_across_unanswered_polls_closes_at_the_answer_that_shows_progress():
    """llama-server answers no /metrics while a prompt batch runs: the polls in between
    read nothing, and the gap still ends at the first answer that shows decode moved."""
    tr = StallTracker(StallSettings(stall_after=600.0), separates_decode=True)
    tr.observe(O(0.0, 7, None, "ready", R(decode=10, hb=0)))
    tr.observe(O(0.5, 7, None, "ready", R(decode=11, hb=1)))
    for t in (1.0, 1.5, 2.0):
        tr.observe(O(t, 7, None, "ready", None, "timeout"))
    v = tr.observe(O(2.5, 7, None, "ready", R(decode=12, hb=2)))
    assert v.decode_gap_seconds == 2.0


SLOTS = [  # llama-server /slots (server-context.cpp server_slot::to_json), trimmed
    {"id": 0, "n_ctx": 4096, "speculative": False, "is_processing": True, "id_task": 7,
     "n_prompt_tokens": 12, "next_token": [{"has_next_token": True, "has_new_line": False, "n_remain": -1,
                                            "n_decoded": 40}]},
    {"id": 1, "n_ctx": 4096, "speculative": False, "is_processing": True, "id_task": 9,
     "n_prompt_tokens": 30000, "next_token": [{"has_next_token": True, "has_new_line": False, "n_remain": -1,
                                               "n_decoded": 0}]},
    # released: its last request's count stays on show, and is in tokens_predicted_total now
    {"id": 2, "n_ctx": 4096, "speculative": False, "is_processing": False, "id_task": 3,
     "next_token": [{"has_next_token": False, "has_new_line": False, "n_remain": 0, "n_decoded": 64}]},
    {"id": 3, "n_ctx": 4096, "speculative": False, "is_processing": False},  # never used
]


def _llama_metrics(n_decode: int, predicted: int) -> Samples:
    return Samples.parse(f"# TYPE llamacpp:n_decode_total counter\nllamacpp:n_decode_total {n_decode}\n"
                         f"# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total {predicted}\n"
                         "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n")


def test_llama_decode_progress_is_generated_tokens_not_decode_calls():
    adapter = Adapter(engine_cfg("e", "llamacpp", "http://127.0.0.1:1", process={"cmdline": "x"}))
    assert slots_decoded(json.dumps(SLOTS)) == 40.0  # the processing slots' generated tokens
    a = adapter.read(_llama_metrics(100, 64), slots_decoded(json.dumps(SLOTS)))
    # two prompt-only decode calls: n_decode_total moved, no request got a token
    b = adapter.read(_llama_metrics(102, 64), slots_decoded(json.dumps(SLOTS)))
    assert a.decode == b.decode == 64 + 40
    assert b.heartbeat == 102  # the heartbeat is still every decode call: a prompt batch is work
    # a token for slot 0
    SLOTS2 = json.loads(json.dumps(SLOTS))
    SLOTS2[0]["next_token"][0]["n_decoded"] = 41
    assert adapter.read(_llama_metrics(103, 64), slots_decoded(json.dumps(SLOTS2))).decode == 64 + 41
    # without /slots (--no-slots) there is no live decode counter: absent, never n_decode_total
    assert adapter.read(_llama_metrics(104, 64), None).decode is None


@pytest.mark.parametrize("body", ["not json", "{}", '[{"id": 0, "is_processing": true, "next_token": "x"}]'])
def test_unreadable_slots_give_no_decode_value(body):
    assert slots_decoded(body) is None


# ------------------------------------------------------------------ ground truth

POLL = 0.25
SLACK = 0.1  # token delivery over HTTP and poll scheduling on a loaded 2-core box
RATE, BATCH = 8192, 2048  # prompt tokens/s, tokens per step
PROMPT = 3 * RATE  # the long prompt: 12 batches, ~3 s


class StreamClient:
    """One streaming request; the arrival time of each token (SSE event) it receives."""

    def __init__(self, url: str, path: str, body: dict, read_timeout: float = 60.0) -> None:
        self.read_timeout = read_timeout
        self.times: list[float] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(url + path, body), daemon=True)
        self._t.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url, json=body, timeout=httpx.Timeout(self.read_timeout)) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.times.append(time.monotonic())
                    if self._stop.is_set():
                        return
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            if not self._stop.is_set():
                self.error = exc

    def longest_gap(self) -> float:
        return max(b - a for a, b in zip(self.times, self.times[1:]))

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=10)


def measure(sim, kind: str, stream_path: str, stream_body: dict) -> tuple[float, float]:
    """-> (the client's longest no-token gap, the gauge's value after the gap closed)."""
    cfg = engine_cfg(f"{kind}-gap", kind, sim.url, process={"cmdline": rf"--kind {kind} --port {sim.port}( |$)"},
                     poll_interval=POLL, http_timeout=2.0, stall_after=120.0)
    wd = EngineWatchdog([cfg], lambda rec: None, lambda ev: None)
    client = StreamClient(sim.url, stream_path, stream_body)
    seen: list[float] = []

    def gauge():
        s = wd.snapshots().get(cfg.name)
        if s is not None and s.decode_gap_seconds is not None:
            seen.append(s.decode_gap_seconds)
        return s

    async def scenario():
        # decoding, seen by the watchdog for a few polls
        assert await run_watchdog_until(wd, lambda: (s := gauge()) and s.state == "busy" and s.polls >= 6
                                        and len(client.times) > 20, 30), (wd.snapshots(), client.error)
        n = len(client.times)
        # off the event loop: a blocking call here would delay the watchdog's polls
        r = await asyncio.to_thread(httpx.post, f"{sim.url}/sim/requests", timeout=5,
                                    json={"count": 1, "max_tokens": 1, "prompt_tokens": PROMPT})
        r.raise_for_status()

        resumed: dict[str, int] = {}

        def closed():
            gauge()
            polls = wd.snapshots()[cfg.name].polls
            if not resumed:  # the stream resumed after its gap, a few tokens ago
                t = client.times
                gap = next((i for i in range(max(n, 1), len(t)) if t[i] - t[i - 1] > 1.0), None)
                if gap is not None and len(t) > gap + 5:
                    resumed["polls"] = polls
                return False
            return polls >= resumed["polls"] + 3  # the watchdog has polled since

        assert await run_watchdog_until(wd, closed, 60), (seen[-5:], len(client.times), client.error)

    try:
        asyncio.run(scenario())
    finally:
        client.close()
    assert client.error is None, client.error
    return client.longest_gap(), max(seen)


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("kind", ["vllm", "sglang", "llamacpp"])
def test_gauge_is_within_one_poll_of_a_streaming_clients_longest_gap(sims, kind):
    """INCIDENTS §9 replayed: prompt batches starve the running request (--starve-decode)."""
    sim = sims(kind, "--step-time", "0.02", "--prefill-rate", str(RATE), "--batch-size", str(BATCH), "--starve-decode")
    path, body = (("/completion", {"prompt": "hi", "n_predict": 100000, "stream": True}) if kind == "llamacpp" else
                  ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 100000, "stream": True}))
    truth, gauge = measure(sim, kind, path, body)
    print(f"{kind}: client's longest gap {truth:.3f} s, gauge {gauge:.3f} s, poll {POLL} s")
    assert truth > 2.0, truth  # the long prompt did starve the request
    assert abs(gauge - truth) <= POLL + SLACK, f"gauge {gauge:.3f} s, client's longest gap {truth:.3f} s"
