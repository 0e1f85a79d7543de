"""Per-kind knowledge of an engine's own endpoints (ENGINES.md): which /metrics series are
running, waiting, the per-step heartbeat, real-time tokens, decode and prefill progress,
and what a /health answer means. Pure: text and status codes in, `EngineReading` out."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal

from gpuguard.engines.config import EngineConfig
from gpuguard.engines.exposition import Samples, Selector

Health = Literal["ready", "starting", "failed", "timeout", "refused", "error"]
NOT_ANSWERING = ("timeout", "refused", "error")


@dataclass(frozen=True)
class EngineReading:
    """What one /metrics scrape says. None = the engine does not export it."""

    running: float | None
    waiting: float | None
    heartbeat: float | None
    tokens: float | None
    decode: float | None
    prefill: float | None
    # Prompt seconds as the engine measured them (llama-server): rate = Δprefill / Δthis.
    prefill_seconds: float | None = None
    # Tokens generated so far, counted as they are made (not at completion): the rate's
    # source. llama-server: busy slots per decode x decodes (one token per busy slot per step).
    live_tokens: float | None = None

    @property
    def pending(self) -> bool | None:
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0) > 0 or (self.waiting or 0) > 0


@dataclass(frozen=True)
class MetricMap:
    running: tuple[Selector, ...]
    waiting: tuple[Selector, ...]
    heartbeat: tuple[Selector, ...]
    tokens: tuple[Selector, ...]
    decode: tuple[Selector, ...] = ()
    prefill: tuple[Selector, ...] = ()
    prefill_seconds: tuple[Selector, ...] = ()
    # gauge x counter = a live token counter (llama-server's average busy slots per decode)
    slots_per_step: tuple[Selector, ...] = ()
    # Used only when no heartbeat series is present (older engine versions); each must
    # still move every step. Completion-time counters never appear here.
    heartbeat_fallback: tuple[Selector, ...] = ()
    # Decode progress = the counter of finished requests' tokens + the running slots' live
    # n_decoded from /slots (llama-server: nothing in /metrics counts tokens as they are made)
    decode_from_slots: bool = False


def _sel(*texts: str) -> tuple[Selector, ...]:
    return tuple(Selector.parse(t) for t in texts)


METRIC_MAPS: dict[str, MetricMap] = {
    # vLLM V1: iteration_tokens_total is a histogram whose _count is the number of engine
    # steps; generation_tokens_total is credited every step (real-time tokens).
    "vllm": MetricMap(
        running=_sel("vllm:num_requests_running"),
        waiting=_sel("vllm:num_requests_waiting"),
        heartbeat=_sel("vllm:iteration_tokens_total_count"),
        tokens=_sel("vllm:generation_tokens_total"),
        decode=_sel("vllm:generation_tokens_total"),
        prefill=_sel("vllm:prompt_tokens_total"),
        heartbeat_fallback=_sel("vllm:generation_tokens_total", "vllm:prompt_tokens_total"),
    ),
    # SGLang: realtime_tokens_total{mode=decode|prefill_compute} moves every iteration;
    # generation_tokens_total only when a request finishes, and the gauges freeze in a stall.
    "sglang": MetricMap(
        running=_sel("sglang:num_running_reqs"),
        waiting=_sel("sglang:num_queue_reqs"),
        heartbeat=_sel('sglang:realtime_tokens_total{mode="decode"}',
                       'sglang:realtime_tokens_total{mode="prefill_compute"}'),
        tokens=_sel('sglang:realtime_tokens_total{mode="decode"}'),
        decode=_sel('sglang:realtime_tokens_total{mode="decode"}'),
        prefill=_sel('sglang:realtime_tokens_total{mode="prefill_compute"}'),
    ),
    # llama-server: n_decode_total is +1 per llama_decode(); tokens_predicted_total is only
    # credited when a slot is released (flat during a long generation). It is exported as
    # "tokens as reported" and never used as the heartbeat. Decode progress is generated
    # tokens: tokens_predicted_total (credited at release with the slot's n_decoded) plus the
    # processing slots' n_decoded in /slots, never n_decode_total (a decode call may carry
    # only prompt tokens while a running request gets nothing). Each busy slot gets one token per
    # llama_decode (server-context.cpp metrics_post_decode: n_busy_slots += processing
    # slots), so tokens made = n_busy_slots_per_decode x n_decode_total. Prompt tokens and
    # seconds are credited after a synchronised decode: their ratio is the prefill rate.
    "llamacpp": MetricMap(
        running=_sel("llamacpp:requests_processing"),
        waiting=_sel("llamacpp:requests_deferred"),
        heartbeat=_sel("llamacpp:n_decode_total"),
        tokens=_sel("llamacpp:tokens_predicted_total"),
        decode_from_slots=True,
        prefill=_sel("llamacpp:prompt_tokens_total"),
        prefill_seconds=_sel("llamacpp:prompt_seconds_total"),
        slots_per_step=_sel("llamacpp:n_busy_slots_per_decode"),
    ),
}

HEALTH_PATHS = {"vllm": "/health", "sglang": "/health", "llamacpp": "/health", "generic": "/health"}
SLOTS_PATH = "/slots"  # llama-server, on unless --no-slots; answered by the main loop like /metrics


def slots_decoded(body: str) -> float | None:
    """Tokens generated so far by llama-server's processing slots: the sum of
    next_token[0].n_decoded over /slots entries with is_processing (server_slot::to_json).
    None when the answer is not that list (a build without /slots, --no-slots)."""
    try:
        slots = json.loads(body)
    except ValueError:
        return None
    if not isinstance(slots, list):
        return None
    total = 0.0
    for slot in slots:
        if not isinstance(slot, dict):
            return None
        if not slot.get("is_processing"):
            continue  # idle, or released: its count is in tokens_predicted_total now
        nxt = slot.get("next_token")
        nxt = nxt[0] if isinstance(nxt, list) and nxt else nxt  # a list in current builds, an object before
        n = nxt.get("n_decoded") if isinstance(nxt, dict) else None
        if not isinstance(n, (int, float)) or isinstance(n, bool) or math.isnan(n):
            return None
        total += n
    return total


class Adapter:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        base = METRIC_MAPS.get(config.kind)
        over = config.metrics
        if over is not None:
            pick = lambda field, dflt: _sel(*getattr(over, field)) if getattr(over, field) else dflt  # noqa: E731
            base = MetricMap(
                running=pick("running", base.running if base else ()),
                waiting=pick("waiting", base.waiting if base else ()),
                heartbeat=pick("heartbeat", base.heartbeat if base else ()),
                tokens=pick("tokens", base.tokens if base else ()),
                decode=pick("decode", base.decode if base else ()),
                prefill=pick("prefill", base.prefill if base else ()),
                prefill_seconds=base.prefill_seconds if base else (),
                slots_per_step=base.slots_per_step if base else (),
                heartbeat_fallback=() if over.heartbeat else (base.heartbeat_fallback if base else ()),
                decode_from_slots=bool(base and base.decode_from_slots and not over.decode),
            )
        assert base is not None  # generic without metrics is refused by the config
        self.map = base
        self.health_path = config.health_path or HEALTH_PATHS[config.kind]
        self.separates_decode = bool(base.decode) or base.decode_from_slots
        self.slots_path = SLOTS_PATH if base.decode_from_slots else None

    def read(self, samples: Samples, slots_tokens: float | None = None) -> EngineReading:
        """`slots_tokens`: what `slots_decoded` read from /slots this poll (decode_from_slots)."""
        m = self.map
        heartbeat = samples.total(m.heartbeat)
        if heartbeat is None and m.heartbeat_fallback:
            heartbeat = samples.total(m.heartbeat_fallback)
        tokens = samples.total(m.tokens)
        live = tokens
        if m.slots_per_step:
            per_step = samples.total(m.slots_per_step)
            live = per_step * heartbeat if per_step is not None and heartbeat is not None else None
        return EngineReading(
            running=samples.total(m.running),
            waiting=samples.total(m.waiting),
            heartbeat=heartbeat,
            tokens=tokens,
            decode=(None if tokens is None or slots_tokens is None else tokens + slots_tokens) if m.decode_from_slots
            else samples.total(m.decode) if m.decode else None,
            prefill=samples.total(m.prefill) if m.prefill else None,
            prefill_seconds=samples.total(m.prefill_seconds) if m.prefill_seconds else None,
            live_tokens=live,
        )

    def health(self, status: int, body: str) -> Health:
        """Interpret an HTTP answer of the health endpoint."""
        if status == 200:
            return "ready"
        kind = self.config.kind
        if status == 503 and kind == "llamacpp" and "Loading model" in body:
            return "starting"
        if status == 503 and kind == "sglang":
            # Starting and stuck look alike (503); the watchdog's phase tells them apart.
            return "failed"
        return "failed"
