"""The PCIe findings of the running daemon on the FUSE-mounted simulated incident host (real
errno, real processes, a real webhook receiver): a runtime-suspended card's unreadable
files are not a telemetry fault."""
from __future__ import annotations

import httpx
import pytest

from support import WebhookReceiver

pytestmark = [pytest.mark.slow, pytest.mark.fuse, pytest.mark.network]  # registered in pyproject.toml


R9700 = ("0000:05:00.0", "0000:08:00.0")
XTX = ("0000:aa:00.0", "0000:b0:00.0")
NAMES = """
poll: {interval_seconds: 0.2, discover_seconds: 0.5, pcie_interval_seconds: 1}
kernel: {enabled: false}
gpus:
  - {name: r9700-a, match: {pci_id: "1002:7551", index: 0}}
  - {name: r9700-b, match: {pci_id: "1002:7551", index: 1}}
  - {name: xtx-0, match: {bdf: "0000:aa:00.0"}}
  - {name: xtx-1, match: {bdf: "0000:b0:00.0"}}
"""


def walks(d) -> float:
    """PCIe walks the daemon finished (its poll-duration histogram's count)."""
    return d.value("gpuguard_poll_duration_seconds_count", source="pcie") or 0.0


def findings_of(d, bdf: str) -> list[dict]:
    r = httpx.get(f"{d.base}/v1/pcie", timeout=5)
    return [f for f in r.json()["findings"] if f["where"].split(" ", 1)[0] == bdf] if r.status_code == 200 else []


@pytest.fixture
def hook():
    r = WebhookReceiver()
    yield r
    r.close()


def test_a_runtime_suspended_gpu_is_no_telemetry_fault_and_sends_no_alert(sim, start_daemon, wait_for, hook):
    """Every PCIe walk of a runtime-suspended card sent an alert-grade `pcie_telemetry`
    webhook ("power cap not readable … EPERM") while the poller reported the card
    suspended. Its files refuse reads (EPERM on the 6.14 era) because the card sleeps and
    gpuguard does not wake it: the finding says so at OK level, no alert, no warning."""
    # r9700-a expected at Gen4 behind its Gen3 root port: one real alert, so the receiver is seen live
    config = NAMES.replace('index: 0}}', 'index: 0}, expect_link: {gen: 4, width: 16}}', 1)
    d = start_daemon(sim.mount, config + f"webhooks: [{{url: '{hook.url}'}}]\n")
    wait_for(lambda: any(f["check"] == "telemetry" and f["level"] == "OK" and "power cap readable" in f["what"]
                         for f in findings_of(d, XTX[1])), timeout=60, what="xtx-1's telemetry walked")
    assert sim.ctl("suspend", bdf=XTX[1]) is True  # power/control is `auto`
    wait_for(lambda: d.value("gpuguard_gpu_runtime_suspended", gpu="xtx-1") == 1.0, timeout=30,
             what="the poller to see xtx-1 suspended")
    seen = walks(d)
    wait_for(lambda: walks(d) >= seen + 4, timeout=60, what="four PCIe walks of the suspended card")
    telemetry = [f for f in findings_of(d, XTX[1]) if f["check"] == "telemetry"]
    assert [f["level"] for f in telemetry] == ["OK", "OK"], telemetry  # the OD file, the power cap
    assert any("runtime-suspended" in f["what"] for f in telemetry), telemetry
    assert not [f for f in findings_of(d, XTX[1]) if f["check"] == "read"]
    assert d.value("gpuguard_gpu_runtime_suspended", gpu="xtx-1") == 1.0  # still asleep: not woken
    events = httpx.get(f"{d.base}/v1/events", timeout=5).json()
    noise = [(e["kind"], e["severity"]) for e in events
             if e["source"] == "pcie" and e["bdf"] == XTX[1] and e["kind"] in ("pcie_telemetry", "pcie_read")]
    assert noise == []
    assert [b["event"]["kind"] for _, b in hook.got if b["event"]["kind"] in ("pcie_telemetry", "pcie_read")] == []
    # the receiver is live: the walk's real alert reached it
    assert [e["bdf"] for _, e in hook.events("pcie_expect_link")] == [R9700[0]]
