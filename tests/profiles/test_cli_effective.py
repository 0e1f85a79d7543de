import os
import subprocess
import sys
from pathlib import Path

from gpuguard.profiles.effective import effective_findings
from gpuguard.profiles.schema import Profile
from gpuguard.state.snapshot import GpuSnapshot
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.fuse]  # registered in pyproject.toml


REPO = Path(__file__).resolve().parents[2]


def cli(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    return subprocess.run([sys.executable, "-m", "gpuguard", *args], env=env, capture_output=True, text=True, timeout=60)


def test_cli_apply_table_and_exit_codes(tmp_path, mount_sim):
    m = mount_sim()
    cfg = tmp_path / "g.yaml"
    cfg.write_text(f"""
state_dir: {tmp_path / 'state'}
profiles:
  psu-safe: {{power_cap_w: 210, sclk_offset_mhz: -500, vddgfx_offset_mv: -100}}
  too-low: {{sclk_offset_mhz: -900}}
gpus:
  - {{name: r9700-a, match: {{bdf: "0000:05:00.0"}}, profile: psu-safe}}
""")
    bad = cli("apply", "--config", str(cfg), "--sysfs-root", m.mountpoint, "--profile", "too-low", "r9700-a")
    assert bad.returncode == 1 and "sclk_offset_mhz=-900 MHz refused" in bad.stdout
    assert m.recorder.writes == []
    dry = cli("apply", "--config", str(cfg), "--sysfs-root", m.mountpoint, "--dry-run")
    assert dry.returncode == 0 and "would write: pp_od_clk_voltage: s -500" in dry.stdout and m.recorder.writes == []
    ok = cli("apply", "--config", str(cfg), "--sysfs-root", m.mountpoint)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "r9700-a (0000:05:00.0) profile psu-safe: VERIFIED" in ok.stdout
    assert "  power_cap_w               300        210        210" in ok.stdout


def snap(name, mhz, busy=1.0, model="XTX"):
    return GpuSnapshot(name=name, bdf="0000:aa:00.0", vendor="1002", device_id="744c", driver="amdgpu", model=model,
                       card=None, up=True, time=0.0, busy_ratio=busy, clocks_hz={"sclk": mhz * 1e6})


def test_effective_check_incident_3():
    prof = ("cap1500", Profile(sclk_max_mhz=1500))
    observed, f, _ = effective_findings((snap("xtx-a", 1233), snap("xtx-b", 1480)), {"xtx-a": prof, "xtx-b": prof})
    kinds = {(x.gpu, x.kind) for x in f}
    assert ("xtx-a", "below_limit") in kinds and ("xtx-a", "card_mismatch") in kinds
    assert "runs at 1233 MHz" in next(x.message for x in f if x.kind == "below_limit")
    assert observed == {"xtx-a": 1233, "xtx-b": 1480}
    _, f, _ = effective_findings((snap("xtx-a", 2371),), {"xtx-a": prof})
    assert [x.kind for x in f] == ["above_limit"]
    _, f, _ = effective_findings((snap("xtx-a", 400, busy=0.1),), {"xtx-a": prof})
    assert f == []  # idle: no finding


def test_card_against_card_whatever_the_profiles():
    """INCIDENTS §3: two identical XTX under the same load, 1233 vs 1802 MHz: they disagree,
    and the finding names both and the limit on the slow one."""
    limited = ("xtx-1500", Profile(sclk_max_mhz=1500))
    a, b = snap("xtx-a", 1233), snap("xtx-b", 1802)
    _, f, _ = effective_findings((a, b), {"xtx-a": limited})
    mm = [x for x in f if x.kind == "card_mismatch"]
    assert [(x.gpu, x.peer) for x in mm] == [("xtx-a", "xtx-b")]
    assert "xtx-a and xtx-b (XTX) disagree" in mm[0].message and "1233" in mm[0].message and "1802" in mm[0].message
    assert "profile xtx-1500 on xtx-a limits SCLK to 1500 MHz" in mm[0].message
    # No profile at all: the cards still disagree; the cause is read from the OD state.
    from gpuguard.state.snapshot import OdState

    a2 = GpuSnapshot(**{**a.__dict__, "od": OdState("rdna3", {"sclk_max_mhz": 1500})})
    b2 = GpuSnapshot(**{**b.__dict__, "od": OdState("rdna3", {"sclk_max_mhz": 2500})})
    _, f, _ = effective_findings((a2, b2), {})
    assert [x.kind for x in f] == ["card_mismatch"] and "OD SCLK maximum reads 1500 MHz" in f[0].message
    # Not comparable load, or a different model: no finding.
    assert effective_findings((a, snap("xtx-b", 1802, busy=0.5)), {}, busy=0.4)[1] == []
    other = GpuSnapshot(**{**snap("r9700", 2900, model="R9700").__dict__, "device_id": "7551"})
    assert effective_findings((a, other), {})[1] == []


def test_ledger_metrics():
    from prometheus_client import CollectorRegistry
    from prometheus_client.registry import Collector

    from gpuguard.profiles.apply import CardResult
    from gpuguard.profiles.effective import ClockFinding
    from gpuguard.profiles.ledger import ProfileLedger

    led = ProfileLedger()
    led.record(CardResult("xtx-a", "0000:aa:00.0", "cap1500", "mismatch", False, "x"))
    led.record(CardResult("xtx-a", "0000:aa:00.0", "cap1500", "ok", True, "y"))
    led.record(CardResult("xtx-b", "0000:b0:00.0", "cap1500", "refused", False, "z"))
    led.set_effective({"xtx-a": ("cap1500", 1233.0)},
                      [ClockFinding("xtx-a", "cap1500", "below_limit", 1233.0, 1500, "m")], ())

    class C(Collector):
        def collect(self):
            return led.metrics()

    reg = CollectorRegistry()
    reg.register(C())
    v = reg.get_sample_value
    assert v("gpuguard_profile_verified", {"gpu": "xtx-a", "profile": "cap1500"}) == 1.0
    assert v("gpuguard_profile_verified", {"gpu": "xtx-b", "profile": "cap1500"}) == 0.0
    assert v("gpuguard_profile_apply_total", {"gpu": "xtx-a", "profile": "cap1500", "result": "mismatch"}) == 1
    assert v("gpuguard_profile_apply_total", {"gpu": "xtx-b", "profile": "cap1500", "result": "refused"}) == 1
    assert v("gpuguard_profile_effective_clock_hertz", {"gpu": "xtx-a", "profile": "cap1500"}) == 1233e6
    assert v("gpuguard_profile_effective_finding", {"gpu": "xtx-a", "profile": "cap1500", "kind": "below_limit"}) == 1
