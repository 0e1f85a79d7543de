"""The adapters read the reference /metrics samples (rendered from the engines' own metric
definitions) to the values ENGINES.md and the samples' README state; and the simulated
engines export the same families, types and label names as those samples."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.engines.adapters import Adapter
from gpuguard.engines.exposition import Samples
from gpuguard.engines.stall import Observation, StallSettings, StallTracker
from gpuguard.sim.engines import render_llamacpp, render_sglang, render_vllm
from gpuguard.sim.engines_core import Core

from engines_harness import engine_cfg

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


FILES = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llama-server"}


def read(reference, kind: str, which: str):
    text = (reference / "engines" / f"{FILES[kind]}-metrics-{which}.txt").read_text()
    cfg = engine_cfg("e", kind, "http://127.0.0.1:1", process={"cmdline": "x"})
    return Adapter(cfg).read(Samples.parse(text))


def test_vllm_samples(reference):
    t0, t1, idle = (read(reference, "vllm", w) for w in ("busy-t0", "busy-t1", "idle"))
    assert (t0.running, t0.waiting) == (3.0, 0.0)
    # heartbeat = iteration_tokens_total_count (engine steps), not a completion counter
    assert (t0.heartbeat, t1.heartbeat) == (2188.0, 2385.0)
    assert t1.tokens - t0.tokens == 542.0  # generation_tokens_total, credited every step
    assert (t0.prefill, t1.prefill) == (26898.0, 27248.0)
    assert idle.running == 0.0 and idle.pending is False
    assert t0.pending is True


def test_sglang_samples(reference):
    t0, t1, idle = (read(reference, "sglang", w) for w in ("busy-t0", "busy-t1", "idle"))
    assert (t0.running, t0.waiting) == (3.0, 0.0)
    assert t1.decode - t0.decode == 541.0  # realtime_tokens_total{mode="decode"}
    assert t0.tokens == t0.decode  # real-time tokens, never generation_tokens_total (5898)
    assert t0.tokens != 5898.0
    assert t1.heartbeat - t0.heartbeat == 541.0 + (t1.prefill - t0.prefill)
    assert idle.running == 0.0 and idle.pending is False


def test_llamacpp_samples(reference):
    t0, t1, idle = (read(reference, "llamacpp", w) for w in ("busy-t0", "busy-t1", "idle"))
    assert (t0.running, t0.waiting) == (3.0, 0.0)
    assert (t0.heartbeat, t1.heartbeat) == (2541.0, 2738.0)  # n_decode_total: 197 steps
    assert (t0.tokens, t1.tokens) == (5016.0, 5276.0)  # tokens_predicted_total: at slot release
    assert idle.running == 0.0 and idle.pending is False


@pytest.mark.parametrize("kind", ["vllm", "sglang", "llamacpp"])
def test_reference_busy_pair_is_progress_not_stall(reference, kind):
    """t1 was taken 5.0 s after t0; with stall_after 2 s the pair is progress, never a stall."""
    tr = StallTracker(StallSettings(stall_after=2.0))
    tr.observe(Observation(100.0, 7, 0.0, "ready", read(reference, kind, "busy-t0")))
    v = tr.observe(Observation(105.0, 7, 0.0, "ready", read(reference, kind, "busy-t1")))
    assert v.state == "busy" and not v.stalled and v.no_progress_seconds == 0.0
    assert v.tokens_per_second and v.tokens_per_second > 0


def _families(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, (fam.type, set()))[1].update(s.labels)
    return out


@pytest.mark.parametrize("kind", ["vllm", "sglang", "llamacpp"])
def test_sim_exports_reference_names_types_labels(reference, kind):
    core = Core(step_time=0.001)
    core.add(3, max_tokens=100)
    for _ in range(12):
        core.step()
    st = core.state()
    text = {"vllm": lambda: render_vllm(st, "meta-llama/Llama-3.1-8B-Instruct"),
            "sglang": lambda: render_sglang(st, "Qwen/Qwen2.5-7B-Instruct"),
            "llamacpp": lambda: render_llamacpp(st)}[kind]().decode()
    ref = _families((reference / "engines" / f"{FILES[kind]}-metrics-busy-t0.txt").read_text())
    sim = _families(text)
    assert len(sim) >= 10
    for name, (typ, labels) in sim.items():
        assert name in ref, f"sim exports {name}, the reference {kind} does not"
        assert ref[name][0] == typ, f"{name}: type {typ} vs reference {ref[name][0]}"
        assert labels == ref[name][1], f"{name}: labels {labels} vs reference {ref[name][1]}"
    # and the sim's counters move the way the real ones do
    r = Adapter(engine_cfg("e", kind, "http://127.0.0.1:1", process={"cmdline": "x"})).read(Samples.parse(text))
    if kind == "sglang":  # realtime decode + prefill_compute tokens
        assert r.heartbeat == st["generation_tokens"] + st["prompt_tokens"] == 3 * 11 + 3 * 16
    else:  # engine steps / llama_decode() calls
        assert r.heartbeat == st["steps"] == 12
