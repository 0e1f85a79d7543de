"""`gpuguard doctor --config` judges the PSU budget from what the daemon recorded
(INCIDENTS §2): FAIL with the alert's advice when peaks reached the line, WARN near it or
without data, OK with room to spare. Reads the recorder, never writes it."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from gpuguard.config import load_config
from gpuguard.policy.power_doctor import power_findings
from gpuguard.sinks.recorder import FlightRecorder
from gpuguard.state.events import Event

REPO = Path(__file__).resolve().parents[2]


def config(tmp_path, extra="power: {psu_watts: 1300, other_watts: 450, margin_ratio: 0.25}"):
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text(f"state_dir: {tmp_path}\nrecorder: {{path: {tmp_path / 'flight.sqlite'}}}\n{extra}\n")
    return cfg


def record(tmp_path, peak_sums, alert=False):
    rec = FlightRecorder(str(tmp_path / "flight.sqlite"))
    now = time.time()
    rows = [(now - 10 + i, s, 360.0, 450.0, 1300.0, 975.0, int(alert)) for i, s in enumerate(peak_sums)]
    rec.record_power({"power_host": rows}).result()
    if alert:
        advice = [{"gpu": "r9700-a", "text": "r9700-a: ... a power cap alone cannot do it ...; profile "
                                             "{sclk_offset_mhz: -200, vddgfx_offset_mv: -100}"}]
        rec.record(events=[Event("power_headroom_low", "alert", "power", "PSU headroom low", time=now,
                                 fields={"advice": advice})]).result()
    rec.close()


def test_alert_in_the_record_is_a_fail_carrying_its_advice(tmp_path):
    record(tmp_path, [900.0, 560.0, 540.0], alert=True)
    (f,) = power_findings(load_config(str(config(tmp_path))))
    assert f.level == "FAIL" and f.check == "power"
    assert "1350 W" in f.what and "975 W line" in f.what and "1300 W supply" in f.what
    assert "cap alone cannot" in f.todo and "vddgfx_offset_mv: -100" in f.todo


def test_near_the_line_is_a_warning_and_far_below_is_ok(tmp_path):
    record(tmp_path, [450.0, 460.0])                      # 910 W of 975
    (f,) = power_findings(load_config(str(config(tmp_path))))
    assert f.level == "WARN" and "910 W" in f.what
    os.unlink(tmp_path / "flight.sqlite")
    record(tmp_path, [300.0, 310.0])
    (f,) = power_findings(load_config(str(config(tmp_path))))
    assert f.level == "OK"


def test_no_budget_configured_no_finding_and_no_record_is_a_warning(tmp_path):
    assert power_findings(load_config(str(config(tmp_path, extra="")))) == []
    (f,) = power_findings(load_config(str(config(tmp_path))))
    assert f.level == "WARN" and "flight.sqlite" in f.what


def test_cli_doctor_prints_the_power_verdict_and_fails(tmp_path):
    record(tmp_path, [600.0], alert=True)
    empty = tmp_path / "root"
    empty.mkdir()
    p = subprocess.run([sys.executable, "-m", "gpuguard", "doctor", "--sysfs-root", str(empty), "--config",
                        str(config(tmp_path))], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO / "daemon")}, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    line = next(ln for ln in p.stdout.splitlines() if " power " in ln)
    assert line.startswith("FAIL") and "INCIDENTS §2" in line and "vddgfx_offset_mv: -100" in line
