"""`gpuguard doctor --config FILE`: the PSU budget verdict from what the daemon recorded
(INCIDENTS §2). Reads the flight recorder (read-only): the worst interval of GPU peaks +
`power.other_watts` against `power.psu_watts · (1 - margin_ratio)`, and the advice of the
last headroom alert — computed by the daemon at that moment from the observed
peak-to-average ratio, the card's cap floor, its voltage and clock under load. Writes
nothing."""
from __future__ import annotations

import json
import os
import sqlite3
import time
from typing import Any

from gpuguard.policy.doctor import Finding

LOOKBACK_S = 86400.0
NEAR_RATIO = 0.9  # within 10 % of the line: a warning


def power_findings(config: Any, now: float | None = None, lookback_s: float = LOOKBACK_S) -> list[Finding]:
    p = config.power
    if p.psu_watts is None:
        return []
    limit = p.psu_watts * (1 - p.margin_ratio)
    path = config.recorder.path
    if not config.recorder.enabled or not os.path.exists(path):
        return [Finding("WARN", "power", f"no flight recorder at {path}: no power peaks to judge the "
                        f"{p.psu_watts:g} W supply against", "host",
                        "run the daemon under load with recorder.enabled, then run doctor again")]
    since = (now or time.time()) - lookback_s
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            worst = db.execute(
                "SELECT t, gpu_peak_sum_w, gpu_mean_sum_w FROM power_host WHERE t >= ? AND gpu_peak_sum_w IS NOT NULL "
                "ORDER BY gpu_peak_sum_w DESC LIMIT 1", (since,)).fetchone()
            alert = db.execute(
                "SELECT t, message, fields FROM events WHERE kind = 'power_headroom_low' AND t >= ? ORDER BY t DESC LIMIT 1",
                (since,)).fetchone()
        finally:
            db.close()
    except sqlite3.Error as e:
        return [Finding("WARN", "power", f"flight recorder {path} unreadable: {e}", "host",
                        "check the file and its permissions (doctor reads it, never writes)")]
    if worst is None:
        return [Finding("WARN", "power", f"no power peaks recorded in {path} in the last {lookback_s / 3600:g} h",
                        "host", "run the daemon with power.sampler on and the GPUs under load")]
    t, peak_sum, mean_sum = worst
    host_peak = peak_sum + p.other_watts
    host_mean = (mean_sum or 0.0) + p.other_watts
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    what = (f"worst interval {when}: GPU peaks {peak_sum:.0f} W + other {p.other_watts:.0f} W = {host_peak:.0f} W "
            f"against the {limit:.0f} W line of the {p.psu_watts:g} W supply (averages {host_mean:.0f} W)")
    if alert is not None:
        fields = json.loads(alert[2] or "{}")
        advice = [a["text"] for a in fields.get("advice", []) if a.get("text")]
        todo = " ".join(advice) or "lower clock and voltage (OD offsets), not only the cap (INCIDENTS §2)"
        return [Finding("FAIL", "power", what + "; peaks reached the line, the supply can trip (INCIDENTS §2)", "host",
                        todo)]
    if host_peak >= limit:
        return [Finding("FAIL", "power", what, "host",
                        "lower clock and voltage (OD offsets), not only the cap (INCIDENTS §2)")]
    if host_peak >= NEAR_RATIO * limit:
        return [Finding("WARN", "power", what + f"; within {100 * (1 - host_peak / limit):.0f} % of the line", "host",
                        "watch gpuguard_host_power_peak_watts; an undervolt (vddgfx_offset_mv) buys headroom")]
    return [Finding("OK", "power", what, "host")]


def power_findings_from_file(config_path: str) -> list[Finding]:
    """The power findings of a config file; a config that does not load is one FAIL."""
    from gpuguard.config import ConfigError, load_config

    try:
        config = load_config(config_path)
    except ConfigError as e:
        return [Finding("FAIL", "power", f"config not loaded: {e}", "host", "fix the config (gpuguard config check)")]
    return power_findings(config)
