"""The shipped alert rules: valid for Prometheus, passing their promtool unit tests, every rule
tested firing and not firing, and shaped the same way (for/severity/what-to-do)."""
from __future__ import annotations

import re
import pytest

pytestmark = [pytest.mark.slow]  # registered in pyproject.toml


# Public contract (DESIGN.md): silences, routes and runbooks refer to these names.
# Renaming one needs a migration note in the README; then update this list.
CONTRACT_ALERTS = {
    "GpuguardGpuDown",
    "GpuguardLargeBarInactive",
    "GpuguardGpuHang",
    "GpuguardGpuDeviceLost",
    "GpuguardGpuResetFailed",
    "GpuguardKernelLogLost",  # kernel log records overwritten before gpuguard read them
    "GpuguardPcieLinkDowngraded",
    "GpuguardPcieUncorrectableErrors",
    "GpuguardProfileUnverified",
    "GpuguardProfileApplyFailing",
    "GpuguardTemperatureNearEmergency",
    "GpuguardTemperatureEmergency",
    "GpuguardPowerAtCap",
    "GpuguardPsuHeadroomLow",  # issue 17: INCIDENTS §2, peaks against the PSU
    "GpuguardEngineStalled",
    "GpuguardEngineDown",
    "GpuguardEngineRestartLoop",
    "GpuguardEngineExposed",  # INCIDENTS §10: an engine API open to the network without a key
    "GpuguardCacheZeroByteFiles",
    "GpuguardDown",
    "GpuguardAbsent",
    "GpuguardNotPolling",
    "GpuguardPollErrors",
    "GpuguardWebhookFailing",
    # NVIDIA health through NVML (issue 18)
    "GpuguardGpuThrottledHardware",
    "GpuguardGpuEccUncorrectable",
    "GpuguardGpuRowRemapPending",
    "GpuguardGpuRowRemapFailure",
    "GpuguardNvidiaXid",
}


def test_promtool_check_rules(run_promtool):
    rc, out = run_promtool("check", "rules", "alerts.yml")
    assert rc == 0, out
    assert f"SUCCESS: {len(CONTRACT_ALERTS)} rules found" in out, out


def test_promtool_unit_tests_pass(run_promtool):
    rc, out = run_promtool("test", "rules", "alerts_test.yml")
    assert rc == 0, out
    assert "SUCCESS" in out, out


def test_alert_names_are_the_contract(alert_rules):
    names = [r["alert"] for r in alert_rules]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert set(names) == CONTRACT_ALERTS


def test_every_rule_says_how_long_how_bad_and_what_to_do(alert_rules):
    for r in alert_rules:
        where = f"{r['group']}/{r['alert']}"
        assert "for" in r, f"{where}: no `for:` (write `for: 0s` for alerts that fire at once)"
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, where
        ann = r["annotations"]
        assert ann.get("summary") and ann.get("description"), where
        # A description names the action or the incident it comes from, not only the symptom.
        assert re.search(r"INCIDENTS §\d|gpuguard \w+|systemctl|Check|check", ann["description"]), where


def test_groups_one_per_concern(alert_rules):
    groups = {r["group"] for r in alert_rules}
    assert all(g.startswith("gpuguard-") for g in groups), groups
    assert {"gpuguard-gpu", "gpuguard-kernel", "gpuguard-pcie", "gpuguard-profiles", "gpuguard-thermal",
            "gpuguard-power", "gpuguard-engines", "gpuguard-caches", "gpuguard-self", "gpuguard-nvidia"} == groups


def test_every_rule_is_tested_firing_and_not_firing(alert_rules, alert_tests):
    doc = alert_tests
    fired, quiet = set(), set()
    for case in doc["tests"]:
        for t in case.get("alert_rule_test", []):
            (fired if t.get("exp_alerts") else quiet).add(t["alertname"])
    names = {r["alert"] for r in alert_rules}
    assert names - fired == set(), "rules never shown firing"
    assert names - quiet == set(), "rules never shown staying quiet"
    # Firing cases check the rendered annotations too (templates are easy to break).
    for case in doc["tests"]:
        for t in case.get("alert_rule_test", []):
            for a in t.get("exp_alerts") or []:
                assert a.get("exp_annotations", {}).get("description"), (t["alertname"], t["eval_time"])


def test_alertmanager_example_is_valid_and_inhibits_per_gpu_alerts_while_gpuguard_is_down(tmp_path):
    """grafana/alertmanager.example.yml: amtool accepts it; GpuguardDown mutes the other gpuguard
    alerts of its instance (they are held by alerts.yml, not resolved: issue 21)."""
    import shutil
    import subprocess

    import pytest
    import yaml

    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "grafana" / "alertmanager.example.yml"
    amtool = shutil.which("amtool")
    if amtool is None:
        pytest.skip("amtool not installed (Debian package `prometheus-alertmanager`)")
    p = subprocess.run([amtool, "check-config", str(path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    rules = yaml.safe_load(path.read_text())["inhibit_rules"]
    down = [r for r in rules if r["source_matchers"] == ['alertname="GpuguardDown"']]
    assert down and down[0]["equal"] == ["instance"]
    assert 'alertname!~"GpuguardDown|GpuguardAbsent"' in down[0]["target_matchers"]
