"""Prometheus families of the engine watchdog, from its in-memory snapshots (a scrape
never talks to an engine). Names from reference/METRICS.md; an unknown value (an engine
that did not answer) is absent, never zero."""
from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from gpuguard.engines.watchdog import PAUSE_BUCKETS, EngineWatchdog


def engine_metrics(wd: EngineWatchdog) -> Iterable[Metric]:
    snaps = wd.snapshots()
    up = GaugeMetricFamily("gpuguard_engine_up", "1 = the engine's health endpoint answers ready", labels=["engine"])
    running = GaugeMetricFamily("gpuguard_engine_requests_running", "Requests the engine is running", labels=["engine"])
    waiting = GaugeMetricFamily("gpuguard_engine_requests_waiting", "Requests queued in the engine", labels=["engine"])
    tokens = CounterMetricFamily("gpuguard_engine_generated_tokens", "Generated tokens as reported by the engine",
                                 labels=["engine"])
    tps = GaugeMetricFamily("gpuguard_engine_tokens_per_second",
                            "Tokens generated per second between the last two answered scrapes (llama-server: busy "
                            "slots x decode steps); absent when the engine did not answer this poll", labels=["engine"])
    gap = GaugeMetricFamily("gpuguard_engine_no_progress_seconds",
                            "Time since any progress counter (steps, live tokens, prompt tokens) last advanced while "
                            "requests were pending", labels=["engine"])
    dgap = GaugeMetricFamily("gpuguard_engine_decode_gap_seconds",
                             "Longest time without decode progress while requests ran, over the last 300 s "
                             "(INCIDENTS §9: prefill starving decode): from the last poll that saw generated "
                             "tokens move to the first that saw them move again, so the true gap lies within one "
                             "poll interval (the engine's poll_interval) of it. llama-server: its slots' n_decoded "
                             "from /slots (absent with --no-slots)", labels=["engine"])
    stalled = GaugeMetricFamily("gpuguard_engine_stalled", "1 = the watchdog declared a stall", labels=["engine"])
    ready = GaugeMetricFamily("gpuguard_engine_time_to_ready_seconds",
                              "Start of the engine's current process to its first ready health answer", labels=["engine"])
    cpu = GaugeMetricFamily("gpuguard_engine_cpu_ratio", "CPU of the engine's GPU-owning process, cores", labels=["engine"])
    for name, s in sorted(snaps.items()):
        up.add_metric([name], 1.0 if s.up else 0.0)
        stalled.add_metric([name], 1.0 if s.stalled else 0.0)
        gap.add_metric([name], s.no_progress_seconds)
        for fam, value in ((running, s.requests_running), (waiting, s.requests_waiting), (tokens, s.generated_tokens_total),
                           (tps, s.tokens_per_second), (dgap, s.decode_gap_seconds), (ready, s.time_to_ready_seconds),
                           (cpu, None if s.cpu_percent is None else s.cpu_percent / 100.0)):
            if value is not None:
                fam.add_metric([name], value)
    actions = CounterMetricFamily("gpuguard_engine_actions", "Kills, restarts and quarantines by the watchdog",
                                  labels=["engine", "action", "reason"])
    for (engine, action, reason), n in sorted(wd.actions_total().items()):
        actions.add_metric([engine, action, reason], n)
    stalls = CounterMetricFamily("gpuguard_engine_stalls", "Stall episodes declared by the watchdog",
                                 labels=["engine", "reason"])
    for (engine, reason), n in sorted(wd.stalls_total().items()):
        stalls.add_metric([engine, reason], n)
    caches = GaugeMetricFamily("gpuguard_cache_zero_byte_files", "Zero-byte files in a compile cache (INCIDENTS §7)",
                               labels=["cache"])
    for name, scan in sorted(wd.cache_scans().items()):
        if scan.zero_byte_files is not None:
            caches.add_metric([name], scan.zero_byte_files)
    held = GaugeMetricFamily("gpuguard_gpu_process_vram_bytes",
                             "VRAM a process holds on a GPU (DRM fdinfo drm-memory-vram, or NVML); engine = the watched "
                             "engine it belongs to, empty if none", labels=["gpu", "pid", "comm", "engine"])
    for g, gpu, engine in wd.gpu_processes():
        if g.vram_bytes is not None:
            held.add_metric([gpu, str(g.pid), g.comm, engine], float(g.vram_bytes))
    pauses = HistogramMetricFamily("gpuguard_engine_pause_seconds",
                                   "No-progress periods with work pending that ended by themselves: how "
                                   "long freezes last, to choose kill_after", labels=["engine"])
    for name, (buckets, total, count) in sorted(wd.pause_histograms().items()):
        pauses.add_metric([name], [(f"{b:g}", float(n)) for b, n in zip(PAUSE_BUCKETS, buckets)] + [("+Inf", float(count))],
                          total)
    exposed = GaugeMetricFamily("gpuguard_engine_exposed",
                                "1 = the engine listens on this address beyond loopback and its API answered "
                                "without an API key (INCIDENTS §10); 0 = it asked for a key or no API answered "
                                "there. Checked over loopback every 60 s and at each engine start",
                                labels=["engine", "address"])
    for name, found in sorted(wd.exposures().items()):
        for x in found:
            if x.verdict != "unprobed":  # bound to one other address: not asked, so not known
                exposed.add_metric([name, x.listener.endpoint], 1.0 if x.exposed else 0.0)
    yield from (up, running, waiting, tokens, tps, gap, dgap, stalled, ready, cpu, actions, stalls, caches, held, pauses, exposed)
