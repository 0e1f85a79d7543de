"""Policy: kernel records and device events → events, counters, lost GPUs and hook calls."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest
from pydantic import ValidationError

from gpuguard.kernel.config import DEFAULT_POLICY, KernelConfig
from gpuguard.kernel.kmsg import parse_record
from gpuguard.kernel.router import ActionHook, KernelEventRouter
from gpuguard.kernel.rules import Rules
from gpuguard.kernel.udev import DeviceEvent
from gpuguard.state.gpus import GpuStates

GPU = "0000:aa:00.0"
NAMES = {GPU: "gpu0", "0000:b0:00.0": "gpu1"}
_seq = iter(range(1, 10**9))


class _Dev:
    def __init__(self, bdf: str) -> None:
        self.bdf, self.vendor, self.device_id, self.model = bdf, "1002", "744c", "Radeon RX 7900 XTX"


def states(*extra: str) -> GpuStates:
    """The GPU state owner with the two GPUs discovered: lost/back and the counters are
    kept there, not in the router (issue 11)."""
    s = GpuStates()
    s.observe([_Dev(b) for b in (*NAMES, *extra)])
    return s


def rec(text: str, device: str | None = None, level: int = 3):
    dict_lines = f"\n SUBSYSTEM=pci\n DEVICE=+pci:{device}" if device else ""
    return parse_record(f"{level},{next(_seq)},{int(time.monotonic() * 1e6)},-;{text}{dict_lines}\n".encode())


class Recorder:
    """The hooks the profile, watchdog and notifier modules will provide; here they note
    every call so the test can assert the order and count."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_alert(self, event):
        self.calls.append(("alert", event.kind, event.bdf))

    def on_gpu_lost(self, bdf):
        self.calls.append(("lost", bdf))

    def on_gpu_reset_ok(self, bdf):
        self.calls.append(("reset_ok", bdf))

    def on_gpu_fatal(self, bdf, kind):
        self.calls.append(("fatal", bdf, kind))

    def on_gpu_appeared(self, bdf):
        self.calls.append(("appeared", bdf))


@pytest.fixture(scope="module")
def rules() -> Rules:
    return Rules.load()


def test_incident_1_sequence_kills_once_marks_lost_once(rules):
    hooks = Recorder()
    assert isinstance(hooks, ActionHook)
    router = KernelEventRouter(rules, NAMES.get, hooks, states=states("0000:c1:00.0"))
    router.handle_record(rec("amdgpu: sq_intr: error, detail 0x00000000, type 1, sh 0, priv 1, wave_id 0, simd_id 0, wgp_id 0"))
    router.handle_record(rec("amdgpu 0000:aa:00.0: amdgpu: device lost from bus!", GPU))
    for _ in range(8):
        router.handle_record(rec("amdgpu 0000:aa:00.0: amdgpu: GPU Recovery Failed: -19", GPU))
    assert hooks.calls == [
        ("alert", "sq_interrupt", None),
        ("fatal", None, "sq_interrupt"),  # printed without a device: the watchdog decides
        ("alert", "device_lost", GPU),
        ("lost", GPU),
        ("fatal", GPU, "device_lost"),
        ("alert", "gpu_reset_failed", GPU),
    ]
    assert router.counts[("gpu0", "gpu_reset_failed")] == 8
    assert router.counts[("host", "sq_interrupt")] == 1
    assert router.is_lost(GPU) and not router.is_lost("0000:b0:00.0")
    assert {(GPU, "device_lost"), (GPU, "gpu_reset_failed")} <= set(router.conditions)


def test_reset_ok_recovers_once_after_the_last_ok_line(rules):
    hooks = Recorder()

    async def main():
        router = KernelEventRouter(rules, NAMES.get, hooks, recover_settle_s=0.05, states=states("0000:c1:00.0"))
        router.handle_record(rec("amdgpu 0000:aa:00.0: amdgpu: Ring gfx_0.0.0 reset failed", GPU))
        assert router.is_lost(GPU)
        for line in ("amdgpu 0000:aa:00.0: amdgpu: GPU reset succeeded, trying to resume",
                     "amdgpu 0000:aa:00.0: amdgpu: VRAM is lost due to GPU reset!",
                     "amdgpu 0000:aa:00.0: amdgpu: GPU reset(2) succeeded!"):
            router.handle_record(rec(line, GPU))
        assert ("reset_ok", GPU) not in hooks.calls  # not while the card is resuming
        deadline = time.monotonic() + 2
        while ("reset_ok", GPU) not in hooks.calls and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return router

    router = asyncio.run(main())
    assert hooks.calls.count(("reset_ok", GPU)) == 1
    assert not router.is_lost(GPU)
    assert (GPU, "gpu_reset_failed") not in router.conditions  # cleared by gpu_reset_ok


def test_loss_after_reset_ok_cancels_the_recovery(rules):
    hooks = Recorder()

    async def main():
        router = KernelEventRouter(rules, NAMES.get, hooks, recover_settle_s=0.05, states=states("0000:c1:00.0"))
        router.handle_record(rec("amdgpu 0000:aa:00.0: amdgpu: GPU reset(1) succeeded!", GPU))
        router.handle_record(rec("amdgpu 0000:aa:00.0: amdgpu: device lost from bus!", GPU))
        await asyncio.sleep(0.15)  # past the settle time: nothing may fire
        return router

    router = asyncio.run(main())
    assert ("reset_ok", GPU) not in hooks.calls
    assert router.is_lost(GPU)


def test_hooks_run_again_after_the_debounce_window(rules):
    now = [1000.0]
    hooks = Recorder()
    router = KernelEventRouter(rules, NAMES.get, hooks, debounce_s=30, clock=lambda: now[0], states=states("0000:c1:00.0"))
    hang = "amdgpu 0000:b0:00.0: ring comp_1.0.0 timeout, signaled seq=5, emitted seq=7"
    router.handle_record(rec(hang))
    now[0] += 29
    router.handle_record(rec(hang))
    now[0] += 2
    router.handle_record(rec(hang))
    assert hooks.calls.count(("fatal", "0000:b0:00.0", "gpu_hang")) == 2
    assert router.counts[("gpu1", "gpu_hang")] == 3


def test_attribution_prefers_a_configured_gpu_and_host_wide_has_none(rules):
    router = KernelEventRouter(rules, NAMES.get, states=states("0000:c1:00.0"))
    # AER: the root port reports (DEVICE=), the erring device is the GPU.
    aer = router.handle_record(rec("pcieport 0000:a0:02.0: AER: Uncorrected (Non-Fatal) error received: 0000:aa:00.0", "0000:a0:02.0"))
    assert (aer.gpu, aer.bdf, aer.kind) == ("gpu0", GPU, "pcie_aer_uncorrected")
    # DEVICE= wins over the text when both name GPUs.
    p2p = router.handle_record(rec("amdgpu 0000:b0:00.0: amdgpu: PCIe P2P access from peer device 0000:aa:00.0 is not supported by the chipset", "0000:b0:00.0"))
    assert (p2p.gpu, p2p.bdf) == ("gpu1", "0000:b0:00.0")
    # An address that is no configured GPU: kept as bdf, gpu None.
    other = router.handle_record(rec("pcieport 0000:00:1c.4: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)", "0000:00:1c.4"))
    assert (other.gpu, other.bdf) == (None, "0000:00:1c.4")
    oom = router.handle_record(rec("Out of memory: Killed process 4242 (python3) total-vm:1kB, anon-rss:1kB"))
    assert (oom.gpu, oom.bdf, oom.fields["pid"], oom.fields["comm"]) == (None, None, 4242, "python3")
    assert router.counts[("host", "oom_kill")] == 1
    assert router.handle_record(rec("amdgpu 0000:aa:00.0: amdgpu: ring gfx_0.0.0 uses VM inv eng 0 on hub 0", GPU)) is None
    assert router.records_seen == 5


def test_event_list_is_bounded_but_counters_are_not(rules):
    seen = []
    router = KernelEventRouter(rules, NAMES.get, max_events=10, on_event=seen.append, states=states("0000:c1:00.0"))
    for i in range(25):
        router.handle_record(rec(f"INFO: task python3:{i} blocked for more than 120 seconds."))
    assert len(router.events) == 10 and len(seen) == 25
    assert router.counts[("host", "hung_task")] == 25
    assert router.events[-1].message.startswith("INFO: task python3:24 ")
    assert router.events_since(router.events[5].time) == list(router.events)[5:]


def test_a_failing_hook_is_logged_and_handling_goes_on(rules, caplog):
    class Broken(Recorder):
        def on_gpu_fatal(self, bdf, kind):
            raise RuntimeError("watchdog not ready")

        async def on_alert(self, event):
            self.calls.append(("async-alert", event.kind))

    hooks = Broken()

    async def main():
        router = KernelEventRouter(rules, NAMES.get, hooks, states=states("0000:c1:00.0"))
        with caplog.at_level(logging.ERROR):
            router.handle_record(rec("amdgpu 0000:aa:00.0: ring gfx_0.0.0 timeout, signaled seq=1, emitted seq=2", GPU))
            router.handle_record(rec("amdgpu 0000:aa:00.0: amdgpu: device lost from bus!", GPU))
        await asyncio.sleep(0)  # the async hook runs as a task
        await asyncio.sleep(0)
        return router

    router = asyncio.run(main())
    assert router.hook_errors == 1 and "watchdog not ready" in caplog.text
    assert ("async-alert", "gpu_hang") in hooks.calls and ("lost", GPU) in hooks.calls


def test_udev_remove_is_gpu_lost_and_add_is_an_appearance(rules):
    hooks = Recorder()
    router = KernelEventRouter(rules, NAMES.get, hooks, states=states("0000:c1:00.0"))
    pci = DeviceEvent("remove", GPU, "pci", f"/sys/devices/pci0000:a0/{GPU}", GPU, 0x030000)
    drm = DeviceEvent("remove", GPU, "drm", f"/sys/devices/pci0000:a0/{GPU}/drm/card1", "card1")
    lost = router.handle_device(pci)
    assert (lost.kind, lost.gpu, lost.source, lost.severity) == ("gpu_lost", "gpu0", "udev", "critical")
    assert router.handle_device(drm) is None  # one loss, reported once
    assert router.is_lost(GPU)
    assert hooks.calls == [("alert", "gpu_lost", GPU), ("lost", GPU), ("fatal", GPU, "gpu_lost")]
    back = router.handle_device(DeviceEvent("add", GPU, "pci", pci.sys_path, GPU, 0x030000))
    assert back.kind == "gpu_appeared" and "was lost" in back.message
    assert hooks.calls[-1] == ("appeared", GPU)
    assert not router.is_lost(GPU) and (GPU, "gpu_lost") not in router.conditions
    # Not a GPU: a NIC leaving is none of our business; an unknown display device is.
    assert router.handle_device(DeviceEvent("remove", "0000:05:00.0", "pci", "/sys/x/0000:05:00.0", "0000:05:00.0", 0x020000)) is None
    assert router.handle_device(DeviceEvent("remove", "0000:c1:00.0", "pci", "/sys/x/0000:c1:00.0", "0000:c1:00.0", 0x030200)).kind == "gpu_lost"


def test_config_merges_policy_and_names_bad_keys():
    cfg = KernelConfig.model_validate({"policy": {"vm_fault": ["alert", "kill_engines"]}, "allow_userspace": True})
    assert cfg.policy["vm_fault"] == ["alert", "kill_engines"]
    assert cfg.policy["device_lost"] == DEFAULT_POLICY["device_lost"]
    with pytest.raises(ValidationError) as e:
        KernelConfig.model_validate({"policy": {"gpu_hang": ["reboot"]}})
    assert "policy.gpu_hang" in str(e.value)
    with pytest.raises(ValidationError) as e:
        KernelConfig.model_validate({"kmsg": "/dev/kmsg"})
    assert "kmsg" in str(e.value) and "Extra inputs" in str(e.value)
    router = KernelEventRouter(Rules.load(), NAMES.get, Recorder(), cfg.policy, states=states("0000:c1:00.0"))
    hooks = router.hooks
    router.handle_record(rec("amdgpu 0000:aa:00.0: amdgpu: [gfxhub] page fault (src_id:0 ring:24 vmid:1 pasid:1)", GPU))
    assert ("fatal", GPU, "vm_fault") in hooks.calls
