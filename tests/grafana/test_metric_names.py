"""Every metric name the alert rules and the dashboard query is one gpuguard exports: a name in
reference/METRICS.md (the public contract) or one of the extras listed here."""
from __future__ import annotations

import re

import pytest

# Names queried that METRICS.md does not list, each with why it exists.
EXTRA_NAMES = {
    # Exported by the service branch (webhook notifier): a dead webhook is counted, not fatal.
    "gpuguard_webhook_failures_total",
    # Exported by the foundation (sinks/metrics.py): a runtime-suspended GPU is not woken to poll.
    "gpuguard_gpu_runtime_suspended",
    # Exported by the power watch (issue 17, policy/power_watch.py): GPU peaks + other_watts
    # reached the PSU's alert line (INCIDENTS §2).
    "gpuguard_host_power_headroom_alert",
    # ... and each GPU's fast-sampled peak per poll interval, beside its average and cap.
    "gpuguard_gpu_power_peak_watts",
    # Prometheus' own per-target scrape health, used by GpuguardDown.
    "up",
    # Prometheus' own alert series: a gauge rule holds its firing alert while gpuguard is down (issue 21).
    "ALERTS",
    # NVIDIA health through NVML (issue 18, sinks/nvml_metrics.py; README "NVIDIA hosts").
    "gpuguard_gpu_throttle",
    "gpuguard_gpu_throttle_seconds_total",
    "gpuguard_gpu_energy_joules_total",
    "gpuguard_gpu_ecc_errors_total",
    "gpuguard_gpu_row_remap_pending",
    "gpuguard_gpu_row_remap_failure",
    "gpuguard_gpu_remapped_rows_total",
    "gpuguard_gpu_pcie_replays_total",
    "gpuguard_gpu_pcie_tx_bytes_total",
    "gpuguard_gpu_pcie_rx_bytes_total",
    "gpuguard_gpu_process_vram_used_bytes",
    # Stall episodes (issue 21, engines/metrics.py): with `action: kill` the stalled gauge is 1
    # for ~50 ms, never scraped; GpuguardEngineStalled reads this counter too.
    "gpuguard_engine_stalls_total",
    # The kernel log reader's losses (sinks/metrics.py kernel_log_families): records
    # overwritten in the ring before gpuguard read them; GpuguardKernelLogLost reads it.
    "gpuguard_kernel_log_records_lost_total",
    # Engines open to the network without an API key (engines/exposure.py, INCIDENTS §10).
    "gpuguard_engine_exposed",
    # Process start (sinks/metrics.py): a counter of a gpuguard started within a rule's window
    # is new even at its first answer; one seen again after a scrape gap is not.
    "gpuguard_start_time_seconds",
}
# METRICS.md metrics the dashboard deliberately leaves out, and why.
NOT_ON_DASHBOARD = {
    # The settable cap range is a setup fact; `gpuguard status` shows it, the panel shows the cap.
    "gpuguard_gpu_power_cap_min_watts",
    "gpuguard_gpu_power_cap_max_watts",
    "gpuguard_gpu_power_cap_default_watts",
}

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "and", "or",
             "unless", "bool", "inf", "nan"}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are not functions, keywords, label
    names (in `{}` or in by/on/ignoring/... lists), strings, durations or numbers."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", s):
        word = m.group()
        if word.lower() in _KEYWORDS or s[m.end():].lstrip().startswith("("):
            continue
        names.add(word)
    return names


def metrics_md_names(text: str) -> set[str]:
    """Names in METRICS.md's table. A cell may abbreviate siblings: `gpuguard_gpu_vram_used_bytes`,
    `_total_bytes` means gpuguard_gpu_vram_total_bytes (the suffix replaces as many words)."""
    names = set()
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cell = line.split("|")[1]
        words = re.findall(r"`([a-z_:][a-z0-9_:]*)`", cell)
        full = words[0].split("_")
        names.add(words[0])
        for short in words[1:]:
            tail = short.lstrip("_").split("_")
            names.add("_".join(full[: len(full) - len(tail)] + tail))
    return names


def _base(name: str, known: set[str]) -> str:
    for suffix in _HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in known:
            return name[: -len(suffix)]
    return name


@pytest.mark.parametrize(
    "expr, names",
    [
        ('gpuguard_gpu_up{gpu=~"$gpu"} == 0', {"gpuguard_gpu_up"}),
        ('a{level="emergency"} - ignoring(level) b <= 5', {"a", "b"}),
        ("sum by (le, source) (rate(x_bucket[$__rate_interval]))", {"x_bucket"}),
        ("x * 1e6 / 1e9 > bool 2", {"x"}),
        ("x unless x offset 10m or absent(y) and on(instance) time() - z", {"x", "y", "z"}),
        ("sum(rate(x[5m])) by (gpu) > 0", {"x"}),
        ('histogram_quantile(0.99, sum without (gpu) (y{a="b(c)"}))', {"y"}),
    ],
)
def test_promql_metric_names(expr, names):
    assert promql_metric_names(expr) == names


def test_metrics_md_shorthand_expands(reference):
    names = metrics_md_names((reference / "METRICS.md").read_text())
    assert {"gpuguard_gpu_power_cap_max_watts", "gpuguard_gpu_vram_visible_bytes",
            "gpuguard_pcie_link_max_transfers_per_second", "gpuguard_pcie_link_max_width",
            "gpuguard_engine_requests_waiting", "gpuguard_poll_duration_seconds"} <= names
    assert all(n.startswith("gpuguard_") for n in names)


def _used(alert_rules, dashboard, dashboard_exprs) -> dict[str, set[str]]:
    used: dict[str, set[str]] = {}
    for r in alert_rules:
        for n in promql_metric_names(r["expr"]):
            used.setdefault(n, set()).add(f"alert {r['alert']}")
    for where, expr in dashboard_exprs:
        for n in promql_metric_names(expr):
            used.setdefault(n, set()).add(f"dashboard {where}")
    for v in dashboard["templating"]["list"]:
        m = re.fullmatch(r"label_values\((\w+)(?:\{[^}]*\})?,\s*\w+\)", v["query"]["query"])
        assert m, f"variable {v['name']}: query {v['query']['query']!r} is not label_values(metric, label)"
        used.setdefault(m.group(1), set()).add(f"variable ${v['name']}")
    return used


def test_rules_and_dashboard_use_only_exported_names(reference, alert_rules, dashboard, dashboard_exprs):
    known = metrics_md_names((reference / "METRICS.md").read_text()) | EXTRA_NAMES
    used = _used(alert_rules, dashboard, dashboard_exprs)
    unknown = {n: sorted(w) for n, w in used.items() if _base(n, known) not in known}
    assert unknown == {}, "names neither in METRICS.md nor in EXTRA_NAMES"


def test_dashboard_shows_every_contract_metric(reference, dashboard, dashboard_exprs):
    contract = metrics_md_names((reference / "METRICS.md").read_text())
    shown = {_base(n, contract) for _, e in dashboard_exprs for n in promql_metric_names(e)}
    shown |= {v["query"]["query"].split("(")[1].split(",")[0].split("{")[0] for v in dashboard["templating"]["list"]}
    assert contract - shown - NOT_ON_DASHBOARD == set(), "METRICS.md metrics missing from the dashboard"
