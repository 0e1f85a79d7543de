"""Doctor findings: downgrades (busy vs idle), lost lanes, expected links, BAR, AtomicOps,
AER, pairs, telemetry sanity, and the config loader's error messages."""
from __future__ import annotations

import pytest

from gpuguard.hw.pcie import walk
from gpuguard.hw.pcie_expect import ExpectedLink
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.config import ConfigError, load_config
from gpuguard.policy.doctor import diagnose, events, exit_status, expected_from_config

XTX = ("0000:aa:00.0", "0000:b0:00.0")
R9700 = ("0000:05:00.0", "0000:08:00.0")


def run(tree, busy=None, expected=None, lines=()):
    root = SysfsRoot(str(tree.base))
    rep = walk(root, busy if busy is not None else {b: True for b in XTX + R9700})
    return diagnose(root, rep, expected or {}, lines)


def pick(findings, check, where_prefix, level=None):
    return [f for f in findings if f.check == check and f.where.startswith(where_prefix) and (level is None or f.level == level)]


def test_slow_slot_under_load_fails_and_names_the_hop(incident):
    fs = run(incident)
    fail = pick(fs, "link", XTX[0], "FAIL")
    assert len(fail) == 1
    assert "a7:00.0→a8:00.0" in fail[0].where
    assert "5.0 GT/s x16" in fail[0].what and "16.0 GT/s x16" in fail[0].what
    assert fail[0].todo
    # The switch-internal ports are never blamed.
    assert not [f for f in fs if "a2:04.0" in f.where or "a3:00.0" in f.where]
    assert exit_status(fs) == 2


def test_slow_slot_while_idle_is_power_saving_unless_dpm_asks_for_more(build_incident):
    tree = build_incident(xtx_busy=0)
    fs = run(tree, busy={})
    # pp_dpm_pcie's active level asks for 16 GT/s while the link runs 5: not power saving.
    assert pick(fs, "link", XTX[0], "FAIL")
    for bdf in XTX:
        tree.set(bdf, "pp_dpm_pcie", "0: 2.5GT/s, x1 78Mhz *\n1: 16.0GT/s, x16 623Mhz \n")
    fs = run(tree, busy={})
    ok = pick(fs, "link", XTX[0])
    assert [f.level for f in ok] == ["OK"] and "idle" in ok[0].what


def test_lost_lane_fails_even_when_idle(build_incident):
    fs = run(build_incident(xtx_slot_width=8), busy={})
    fail = pick(fs, "link", XTX[0], "FAIL")
    assert fail and "lost lanes" in fail[0].what


def test_narrowest_line_for_r9700_names_the_root_port(incident):
    fs = run(incident)
    n = pick(fs, "narrowest", R9700[0])
    assert n[0].level == "OK" and "limited by 00:02.0 (root port)" in n[0].what and "15.75 GB/s" in n[0].what


def test_expected_link_mismatch_is_alert_grade(incident):
    expected = {XTX[0]: ExpectedLink(gen=4, width=16), R9700[0]: ExpectedLink(gen=4, width=16),
                R9700[1]: ExpectedLink(gen=3, width=16), "0000:99:00.0": ExpectedLink(width=16)}
    fs = run(incident, expected=expected)
    x = pick(fs, "expect_link", XTX[0])
    assert x[0].level == "FAIL" and "running 5.0 GT/s under load" in x[0].what
    r = pick(fs, "expect_link", R9700[0])
    assert r[0].level == "FAIL" and "capable of only 8.0 GT/s" in r[0].what  # Gen3 root port
    assert pick(fs, "expect_link", R9700[1])[0].level == "OK"
    assert pick(fs, "expect_link", "0000:99:00.0")[0].level == "FAIL"
    evs = events(fs)
    ev = [e for e in evs if e.kind == "pcie_expect_link" and e.bdf == XTX[0]]
    assert ev and ev[0].alert_grade


def test_bar_atomics_aer_pairs(build_incident):
    fs = run(build_incident(root_devcap2=0))
    assert pick(fs, "bar", XTX[0])[0].level == "WARN"
    assert "large BAR not active" in pick(fs, "bar", XTX[0])[0].what
    assert pick(fs, "bar", R9700[0])[0].level == "OK"
    a = pick(fs, "atomics", R9700[0])
    assert a[0].level == "FAIL" and "32bit- 64bit-" in a[0].what  # amdgpu: HIP refuses
    aer = pick(fs, "aer", XTX[0])
    assert aer[0].level == "WARN" and "3 correctable" in aer[0].what
    pairs = [f for f in fs if f.check == "pair"]
    assert len(pairs) == 6
    # INCIDENTS §5: under one switch, but 256 MiB BARs: no P2P, and doctor says why.
    xtx = [f for f in pairs if f.where == f"{XTX[0]} ↔ {XTX[1]}"]
    assert [f.level for f in xtx] == ["WARN"] and "256 MiB" in xtx[0].what and "Resizable BAR" in xtx[0].todo


def test_atomics_unknown_without_root(build_incident):
    fs = run(build_incident(config="truncated"))
    a = pick(fs, "atomics", XTX[0])
    assert a[0].level == "WARN" and "needs root" in a[0].what


def test_telemetry_sanity(incident):
    incident.remove(XTX[0], "pp_od_clk_voltage")
    incident.set(XTX[1], "hwmon/hwmon3/power1_cap", "garbage\n")
    fs = run(incident)
    od = pick(fs, "telemetry", XTX[0], "FAIL")
    assert od and "pp_od_clk_voltage missing" in od[0].what and "ppfeaturemask" in od[0].todo
    cap = pick(fs, "telemetry", XTX[1], "FAIL")
    assert cap and "power cap not readable" in cap[0].what and "power1_cap" in cap[0].what
    assert [f.level for f in pick(fs, "telemetry", R9700[0])] == ["OK", "OK"]


def test_kernel_p2p_refusal_is_reported(incident):
    line = "amdgpu 0000:05:00.0: amdgpu: PCIe P2P access from peer device 0000:08:00.0 is not supported by the chipset"
    fs = run(incident, lines=[line])
    host = [f for f in fs if f.where == "host" and f.check == "pair"]
    assert host and host[0].level == "WARN"


def test_no_gpu_is_a_warning():
    from gpuguard.hw.pcie_model import PcieReport

    fs = diagnose(SysfsRoot("/nonexistent"), PcieReport((), (), {}))
    assert exit_status(fs) == 1 and "no GPU found" in fs[0].what


def test_expected_links_come_from_the_daemons_own_loader(tmp_path, incident):
    good = tmp_path / "g.yaml"
    good.write_text(
        "profiles: {quiet: {power_cap_w: 200}}\n"
        "gpus:\n"
        "  - name: xtx\n    match: {bdf: 0000:AA:00.0}\n    expect_link: {gen: 4, width: 16}\n    profile: quiet\n"
        "  - name: r\n    match: {bdf: '05:00.0'}\n"
    )
    rep = walk(SysfsRoot(str(incident.base)))
    assert expected_from_config(load_config(good).gpus, rep) == {"0000:aa:00.0": ExpectedLink(gen=4, width=16)}
    bad = tmp_path / "b.yaml"
    for text, msg in (
        ("gpus:\n  - name: x\n    match: {bdf: '0000:aa:00.0'}\n    expect_link: {gen: 9}\n", r"gpus\[0\]\.expect_link\.gen"),
        ("gpus:\n  - name: x\n    match: {bdf: '0000:aa:00.0'}\n    expect_link: {gen: 4, lanes: 16}\n", r"expect_link\.lanes"),
        ("gpus:\n  - name: x\n    match: {name: x}\n    expect_link: {gen: 4}\n", r"gpus\[0\]\.match"),
        ("gpus: [\n", "not valid YAML"),
    ):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=msg):
            load_config(bad)
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "missing.yaml")


def test_expected_link_by_pci_id_and_index(incident, tmp_path):
    cfg = tmp_path / "g.yaml"
    cfg.write_text(
        "gpus:\n"
        "  - name: xtx-1\n    match: {pci_id: '1002:744C', index: 1}\n    expect_link: {gen: 4, width: 16}\n"
    )
    root = SysfsRoot(str(incident.base))
    rep = walk(root, {b: True for b in XTX})
    expected = expected_from_config(load_config(cfg).gpus, rep)
    assert set(expected) == {XTX[1]}  # index 1 = the second by address, both cards present
    fs = diagnose(root, rep, expected)
    assert pick(fs, "expect_link", XTX[1])[0].level == "FAIL"
    ev = [e for e in events(fs) if e.kind == "pcie_expect_link"]
    assert [e.bdf for e in ev] == [XTX[1]]


def test_expected_link_by_index_fails_closed_when_the_group_is_incomplete(incident, tmp_path):
    """Index 9 configured means ten cards of that id; with two present an index names
    nothing (the daemon's identity rule, issue 11): both entries are reported not found,
    never checked against the wrong card."""
    cfg = tmp_path / "g.yaml"
    cfg.write_text(
        "gpus:\n"
        "  - name: xtx-1\n    match: {pci_id: '1002:744C', index: 1}\n    expect_link: {gen: 4, width: 16}\n"
        "  - name: xtx-9\n    match: {pci_id: '1002:744c', index: 9}\n    expect_link: {width: 16}\n"
    )
    root = SysfsRoot(str(incident.base))
    rep = walk(root, {b: True for b in XTX})
    expected = expected_from_config(load_config(cfg).gpus, rep)
    assert set(expected) == {"1002:744c #1", "1002:744c #9"}
    fs = diagnose(root, rep, expected)
    for label in expected:
        assert pick(fs, "expect_link", label)[0].what.startswith("configured GPU not found")
    ev = [e for e in events(fs) if e.kind == "pcie_expect_link"]
    assert [e.bdf for e in ev] == [None, None]  # a label is not a PCI address
