"""Rules match message families (any ring, any hub, old and new wordings), not the
sample's strings; look-alike benign chatter does not match. Lines below are written from
the kernel's and drivers' format strings with other values than the reference sample."""
from __future__ import annotations

import pytest

from gpuguard.kernel.rules import Rules, RulesError, addresses_in, normalise_bdf

POSITIVE = [
    # drm_sched job timeouts, any ring; soft recovery is still a hang
    ("amdgpu 0000:03:00.0: amdgpu: ring comp_1.2.1 timeout, signaled seq=7, emitted seq=9", "gpu_hang", "0000:03:00.0"),
    ("amdgpu 0000:0c:00.0: amdgpu: ring sdma1 timeout, signaled seq=1022, emitted seq=1024", "gpu_hang", "0000:0c:00.0"),
    ("amdgpu 0000:0c:00.0: amdgpu: ring vcn_dec_0 timeout, but soft recovered", "gpu_hang", "0000:0c:00.0"),
    ("[drm:amdgpu_job_timedout [amdgpu]] *ERROR* ring gfx timeout, signaled seq=5, emitted seq=6", "gpu_hang", None),
    ("radeon 0000:01:00.0: ring 0 stalled for more than 10240msec", "gpu_hang", "0000:01:00.0"),
    ("radeon 0000:01:00.0: GPU lockup (current fence id 0x00000000000a3b12 last fence id 0x00000000000a3b2c on ring 0)", "gpu_hang", "0000:01:00.0"),
    ("i915 0000:00:02.0: [drm] GPU HANG: ecode 12:1:85dffffb, in python3 [4101]", "gpu_hang", "0000:00:02.0"),
    # MES/KFD hang signatures
    ("[drm:mes_v11_0_submit_pkt_and_poll_completion.constprop.0 [amdgpu]] *ERROR* MES failed to response msg=3", "gpu_hang", None),
    ("amdgpu 0000:c3:00.0: amdgpu: MES failed to respond to msg=REMOVE_QUEUE", "gpu_hang", "0000:c3:00.0"),
    ("amdgpu: Failed to evict process queues", "gpu_hang", None),
    ("amdgpu: Queue preemption failed for queue with doorbell_id: 1002", "gpu_hang", None),
    ("amdgpu 0000:03:00.0: amdgpu: The cp might be in an unrecoverable state due to an unsuccessful queues preemption", "gpu_hang", "0000:03:00.0"),
    # resets
    ("amdgpu 0000:03:00.0: amdgpu: GPU reset begin!", "gpu_reset_start", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: GPU reset begin!. Source: 2", "gpu_reset_start", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: Starting gfx_0.0.0 ring reset", "gpu_reset_start", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: MODE1 reset", "gpu_reset_start", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: GPU mode1 reset", "gpu_reset_start", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: GPU psp mode1 reset", "gpu_reset_start", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: GPU pci config reset", "gpu_reset_start", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: GPU reset(1) succeeded!", "gpu_reset_ok", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: Ring sdma0 reset succeeded", "gpu_reset_ok", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: GPU reset(12) failed", "gpu_reset_failed", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: GPU Recovery Failed: -110", "gpu_reset_failed", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: ASIC reset failed with error, -110 for drm dev, 0000:03:00.0", "gpu_reset_failed", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: GPU mode1 reset failed", "gpu_reset_failed", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: Ring gfx_0.1.0 reset failed", "gpu_reset_failed", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: JPEG queue reset failed", "gpu_reset_failed", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: GPU reset end with ret = -110", "gpu_reset_failed", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: GPU reset end with ret = 0", "gpu_reset_ok", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: soft reset failed, will fallback to full reset!", "gpu_reset_failed", "0000:03:00.0"),
    ("[drm:amdgpu_mes_unmap_legacy_queue [amdgpu]] *ERROR* failed to unmap legacy queue", "gpu_hang", None),
    ("amdgpu 0000:03:00.0: amdgpu: IP block:gfx_v11_0 is hung!", "gpu_hang", "0000:03:00.0"),
    # device lost
    ("amdgpu 0000:0a:00.0: amdgpu: device lost from bus!", "device_lost", "0000:0a:00.0"),
    ("NVRM: GPU 0000:65:00.0: GPU has fallen off the bus.", "device_lost", "0000:65:00.0"),
    ("NVRM: The NVIDIA GPU 0000:17:00.0\nNVRM: (PCI ID: 10de:2330) installed in this system has\nNVRM: fallen off the bus and is not responding to commands.", "device_lost", "0000:17:00.0"),
    ("NVRM: fallen off the bus and is not responding to commands.", "device_lost", None),
    ("[drm] PCI error: detected callback, state(3)!!", "device_lost", None),
    # SQ interrupts and VM faults
    ("amdgpu: sq_intr: error, detail 0x00000000, type 2, sh 1, priv 0, wave_id 3, simd_id 1, wgp_id 2", "sq_interrupt", None),
    ("amdgpu 0000:03:00.0: amdgpu: SQ interrupt: error, se 0, data 0x1", "sq_interrupt", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: [mmhub] page fault (src_id:0 ring:169 vmid:0 pasid:0)", "vm_fault", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: [gfxhub0] no-retry page fault (src_id:0 ring:40 vmid:8 pasid:32770)", "vm_fault", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: [mmhub1] retry page fault (src_id:0 ring:0 vmid:1 pasid:1)", "vm_fault", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu:   VM_L2_PROTECTION_FAULT_STATUS:0x00841051", "vm_fault", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: MMVM_L2_PROTECTION_FAULT_STATUS:0x00000000", "vm_fault", "0000:03:00.0"),
    ("radeon 0000:01:00.0:   VM_CONTEXT1_PROTECTION_FAULT_ADDR   0x00000000", "vm_fault", "0000:01:00.0"),
    # AER and DPC
    ("pcieport 0000:00:01.1: AER: Uncorrected (Non-Fatal) error message received from 0000:03:00.0", "pcie_aer_uncorrected", "0000:00:01.1"),
    ("pcieport 0000:00:01.1: AER: Uncorrected (Fatal) error received: 0000:03:00.0", "pcie_aer_uncorrected", "0000:00:01.1"),
    ("amdgpu 0000:03:00.0: PCIe Bus Error: severity=Uncorrected (Non-Fatal), type=Transaction Layer, (Requester ID)", "pcie_aer_uncorrected", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: PCIe Bus Error: severity=Uncorrectable (Fatal), type=Inaccessible, (Unregistered Agent ID)", "pcie_aer_uncorrected", "0000:03:00.0"),
    ("pcieport 0000:00:01.1: AER: Corrected error received: 0000:03:00.0", "pcie_aer_corrected", "0000:00:01.1"),
    ("pcieport 0000:00:03.1: AER: Multiple Corrected error received: 0000:00:03.1", "pcie_aer_corrected", "0000:00:03.1"),
    ("pcieport 0000:00:03.1: DPC: unmasked uncorrectable error detected", "pcie_aer_uncorrected", "0000:00:03.1"),
    ("pcieport 0000:00:03.1: DPC: containment event, status:0x1f01 source:0x0000", "pcie_link_down", "0000:00:03.1"),
    ("pcieport 0000:a0:02.0: pciehp: Slot(7-1): Link Down", "pcie_link_down", "0000:a0:02.0"),
    ("pciehp 0000:a2:08.0:pcie204: Slot(12): Link Down event", "pcie_link_down", "0000:a2:08.0"),
    ("pcieport 0000:00:1c.0: AER: device recovery failed", "pcie_aer_uncorrected", "0000:00:1c.0"),
    ("pcieport 0000:00:1c.0: DPC: ERR_FATAL detected", "pcie_aer_uncorrected", "0000:00:1c.0"),
    ("pcieport 0000:00:1c.0: pciehp: Slot(2): Data Link Layer Link Active not set in 1000 msec", "pcie_link_down", "0000:00:1c.0"),
    # P2P, BAR
    ("nvme 0000:41:00.0: cannot be used for peer-to-peer DMA as ACS redirect is not set between the client and provider (0000:21:00.0)", "p2p_unsupported", "0000:41:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: Not enough PCI address space for a large BAR.", "bar_size", "0000:03:00.0"),
    ("amdgpu 0000:aa:00.0: amdgpu: PCIe P2P access from peer device 0000:05:00.0 is not supported by the chipset", "p2p_unsupported", "0000:aa:00.0"),
    ("nvme 0000:41:00.0: cannot be used for peer-to-peer DMA as the client and provider (0000:21:00.0) do not share an upstream bridge or whitelisted host bridge", "p2p_unsupported", "0000:41:00.0"),
    ("amdgpu 0000:aa:00.0: amdgpu: Detected VRAM RAM=24560M, BAR=256M", "bar_size", "0000:aa:00.0"),
    # thermal
    ("amdgpu: GPU over temperature range detected on PCIe 3:0.0!", "thermal_throttle", None),
    ("amdgpu 0000:03:00.0: amdgpu: WARN: GPU is throttled, expect performance decrease. PPT, TDC.", "thermal_throttle", "0000:03:00.0"),
    ("amdgpu 0000:03:00.0: amdgpu: ERROR: System is going to shutdown due to GPU HW CTF!", "thermal_throttle", "0000:03:00.0"),
    ("CPU12: Package temperature above threshold, cpu clock throttled (total events = 48)", "thermal_throttle", None),
    ("CPU3: Core temperature above threshold, cpu clock throttled (total events = 1)", "thermal_throttle", None),
    # NVIDIA Xid
    ("NVRM: Xid (PCI:0000:65:00): 48, pid=1221, name=python3, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 4, subpartition 0.", "nvidia_xid", "0000:65:00.0"),
    ("NVRM: Xid (PCI:0001:b1:00): 109, pid=88, name=vllm, Ch 00000008, errorString CTX SWITCH TIMEOUT", "nvidia_xid", "0001:b1:00.0"),
    # host
    ("Memory cgroup out of memory: Killed process 88231 (vllm) total-vm:62314508kB, anon-rss:30125588kB", "oom_kill", None),
    ("Out of memory: Kill process 4021 (java) score 912 or sacrifice child", "oom_kill", None),
    ("INFO: task python3:9121 blocked for more than 245 seconds.", "hung_task", None),
    ("INFO: task kworker/u64:3:412 blocked for more than 491 seconds.", "hung_task", None),
]

NEGATIVE = [
    "amdgpu 0000:03:00.0: amdgpu: ring comp_1.3.1 uses VM inv eng 15 on hub 0",
    "amdgpu 0000:03:00.0: amdgpu: ring vcn_unified_0 uses VM inv eng 0 on hub 8",
    "r8169 0000:04:00.0 eth0: RTL8168h/8111h, 00:e0:4c:68:00:01, XID 541, IRQ 131",
    "igb 0000:05:00.0 eno1: igb: eno1 NIC Link is Down",
    "e1000e 0000:00:1f.6 eth0: NIC Link is Down",
    "pcieport 0000:00:1c.0: pciehp: Slot(1): Link Up",
    "pcieport 0000:00:1c.0: pciehp: Slot(1): Card present",
    "pcieport 0000:00:01.0: AER: enabled with IRQ 26",
    "pcieport 0000:00:1c.0: DPC: enabled",
    "pci 0000:03:00.0: 8.000 Gb/s available PCIe bandwidth, limited by 2.5 GT/s PCIe x4 link at 0000:00:1c.4 (capable of 252.048 Gb/s with 16.0 GT/s PCIe x16 link)",
    "pci 0000:03:00.0: BAR 0 [mem 0x7c00000000-0x7fffffffff 64bit pref]: assigned",
    "amdgpu 0000:03:00.0: amdgpu: Using BACO for runtime pm",
    "[drm] GPU recovery disabled.",
    "[drm] PCI error: detected callback, state(1)!!",
    "amdgpu 0000:03:00.0: amdgpu: SMU driver if version not matched",
    "amdgpu: Failed to initialize parser -125!",
    "amdgpu 0000:03:00.0: amdgpu: 24560M of VRAM memory ready",
    "[drm] Fence fallback timer expired on ring sdma0",
    "nvme nvme0: I/O 17 QID 3 timeout, reset controller",
    "usb 1-1: reset high-speed USB device number 2 using xhci_hcd",
    "ata3: hard resetting link",
    "CPU3: Core temperature/speed normal",
    "NVRM: GPU at PCI:0000:65:00: GPU-5f4b2c1e-8a7d-4c1e-9b3a-0d2f1e6c7b8a",
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
    "python3 invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, oom_score_adj=0",
    "task:python3         state:D stack:0     pid:9121  tgid:9121  ppid:1      flags:0x00004002",
    "BUG: unable to handle page fault for address: ffffc90000a1b000",
    "amdgpu 0000:03:00.0: amdgpu: PCIE atomic ops is not supported",
    "pcieport 0000:00:1c.0: AER: broadcast resume message",
    "pcieport 0000:00:1c.0: AER: device recovery successful",
    "amdgpu 0000:03:00.0: amdgpu: Dumping IP State Completed",
    "amdgpu: GPU under temperature range detected on PCIe 3:0.0!",
]


@pytest.fixture(scope="module")
def rules() -> Rules:
    return Rules.load()


@pytest.mark.parametrize("text,kind,bdf", POSITIVE)
def test_family_lines_match(rules, text, kind, bdf):
    m = rules.classify(text)
    assert m is not None, text
    assert (m.kind, m.bdf) == (kind, bdf)


@pytest.mark.parametrize("text", NEGATIVE)
def test_benign_lookalikes_do_not_match(rules, text):
    assert rules.classify(text) is None


def test_captures_become_fields(rules):
    m = rules.classify("[drm] Detected VRAM RAM=24560M, BAR=256M")
    assert dict(m.fields) == {"vram_mib": 24560, "bar_mib": 256, "large_bar": False}
    m = rules.classify("[drm] Detected VRAM RAM=32624M, BAR=32768M")
    assert m.fields["large_bar"] is True
    m = rules.classify("amdgpu 0000:ba:00.0: amdgpu: GPU Recovery Failed: -19")
    assert m.fields["errno"] == -19 and m.condition
    m = rules.classify("amdgpu 0000:83:00.0: amdgpu: PCIe P2P access from peer device 0000:72:00.0 is not supported by the chipset")
    assert m.fields["peer"] == "0000:72:00.0" and m.bdf_all == ("0000:83:00.0", "0000:72:00.0")
    m = rules.classify("amdgpu 0000:5d:00.0: amdgpu: Starting comp_1.3.0 ring reset")
    assert m.fields["ring"] == "comp_1.3.0"
    m = rules.classify("NVRM: Xid (PCI:0000:86:00): 79, GPU has fallen off the bus.")
    assert (m.kind, m.xid, m.severity) == ("nvidia_xid", 79, "critical")
    m = rules.classify("NVRM: Xid (PCI:0000:86:00): 13, Graphics Exception")
    assert (m.xid, m.severity) == (13, "alert")


def test_address_normalisation():
    assert normalise_bdf("PCI:0000:3B:00") == "0000:3b:00.0"
    assert normalise_bdf("+pci:0000:03:00.1") == "0000:03:00.1"
    assert normalise_bdf("03:00.0") == "0000:03:00.0"
    assert normalise_bdf("no address here 12:34:56") is None
    assert addresses_in("pciehp 0000:6d:05.0:pcie24: slot(6)") == ["0000:6d:05.0"]
    assert addresses_in("eth0: 00:e0:4c:68:00:01 at 10:15:30.5") == []


def test_user_rules_come_first_and_can_silence_a_line(tmp_path):
    f = tmp_path / "extra.yaml"
    f.write_text(
        "rules:\n"
        "  - kind: none\n"
        "    pattern: 'ring gfx_0\\.0\\.0 timeout.*lab-card'\n"
        "  - kind: engine_oops\n"
        "    pattern: 'llama-server\\[\\d+\\]: segfault'\n"
        "    severity: alert\n"
    )
    rules = Rules.load(extra_file=f)
    assert rules.classify("amdgpu 0000:03:00.0: ring gfx_0.0.0 timeout, signaled seq=1 lab-card") is None
    assert rules.classify("amdgpu 0000:03:00.0: ring gfx_0.0.0 timeout, signaled seq=1").kind == "gpu_hang"
    assert rules.classify("llama-server[812]: segfault at 0 ip 0").kind == "engine_oops"
    only = Rules.load(builtin=False, extra_file=f)
    assert len(only) == 2


@pytest.mark.parametrize("body,needle", [
    ("rules:\n  - kind: gpu_hang\n    pattern: 'ring (unclosed'\n", "extra.yaml:2: rule 0 (kind 'gpu_hang'): pattern"),
    ("rules:\n  - kind: gpu_hang\n    pattern: x\n  - kind: x\n    pattern: y\n    sevrity: alert\n", "extra.yaml:4: rule 1 (kind 'x'): sevrity"),
    ("rules:\n  - kind: Bad Kind\n    pattern: x\n", "rule 0 (kind 'Bad Kind'): kind"),
    ("rules:\n  - kind: k\n    pattern: x\n    severity: loud\n", "severity"),
    ("rules:\n  - kind: k\n    pattern: x\n    type: sometimes\n", "type"),
    ("- kind: k\n  pattern: x\n", "expected one top-level key `rules:`"),
    ("rules: [\n", "not valid YAML"),
])
def test_bad_rule_files_name_file_rule_and_key(tmp_path, body, needle):
    f = tmp_path / "extra.yaml"
    f.write_text(body)
    with pytest.raises(RulesError) as e:
        Rules.load(extra_file=f)
    assert needle in str(e.value)
    assert str(f) in str(e.value)


def test_missing_rule_file_says_what_to_fix(tmp_path):
    with pytest.raises(RulesError, match="cannot read it.*kernel.rules_file"):
        Rules.load(extra_file=tmp_path / "nope.yaml")


def test_the_literal_prefilter_never_changes_a_result(rules, labelled):
    """Rules skip their regex when none of the literals every match must contain is in
    the line; that shortcut must give the same answer as running every regex."""
    from dataclasses import replace

    plain = Rules([replace(r, needles=None) for r in rules.rules])
    assert sum(r.needles is not None for r in rules.rules) >= len(rules.rules) - 2
    texts = [t for t, _, _ in POSITIVE] + NEGATIVE + [i["text"] for i in labelled]
    for text in texts:
        assert rules.classify(text) == plain.classify(text), text


def test_bar_exactly_as_large_as_vram_is_large_bar(rules):
    """The boundary: a BAR covering all of VRAM, not more, is large BAR (amdgpu's own test
    is visible_vram_size == real_vram_size)."""
    m = rules.classify("[drm] Detected VRAM RAM=16384M, BAR=16384M")
    assert m.fields["large_bar"] is True
    m = rules.classify("[drm] Detected VRAM RAM=16384M, BAR=16383M")
    assert m.fields["large_bar"] is False
