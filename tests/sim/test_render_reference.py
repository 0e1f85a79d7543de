"""Every file the simulator renders is byte-identical to a real amdgpu file when the
simulated card is put into the state the real card was in (reference/amdgpu/)."""
from __future__ import annotations

import pytest

from gpuguard.sim import cards

# (reference prefix, model changes, gpu bus, era, root port link, sensors, writes)
CASES = {
    "rdna4-rx9070xt-powercolor-may2025-": dict(
        model=cards.with_changes(
            cards.R9700, device_id=0x7550, subsystem_vendor=0x148C, subsystem_device=0x2435,
            vbios="113-EXT109069-101", power_default_w=304, power_min_w=0, power_max_w=340,
            sclk_min=500, sclk_max=2400, socclk_levels=(417, 1476)),
        bus=0x0F, era="6.14", link=(16.0, 16),
        sensors=dict(busy_pct=3, power_avg_w=55, temp_edge_c=42, temp_junction_c=45, temp_mem_c=68,
                     sclk_mhz=167, mclk_mhz=1258, socclk_mhz=1280, vddgfx_mv=552, fan_rpm=896),
        dpm_sclk_mhz=16, cap=120, level="auto",
        writes=[("pp_od_clk_voltage", b"vo -50\n"), ("pp_od_clk_voltage", b"c\n")]),
    "rdna4-rx9070-": dict(
        model=cards.with_changes(
            cards.R9700, device_id=0x7550, subsystem_vendor=0x1DA2, subsystem_device=0x2490,
            vbios="113-2E490TX-US2", power_default_w=220, power_min_w=0, power_max_w=245,
            sclk_min=500, sclk_max=2070, socclk_levels=(417, 1476), fan_max_rpm=6000),
        bus=0x03, era="6.14", link=(16.0, 16),
        sensors=dict(busy_pct=25, power_avg_w=49, temp_edge_c=48, temp_junction_c=52, temp_mem_c=72,
                     sclk_mhz=900, mclk_mhz=1124, socclk_mhz=1200, vddgfx_mv=790, fan_rpm=1944),
        dpm_sclk_mhz=789, cap=200, level="auto", writes=[]),
    "rdna3-rx7900xtx-nitro-e471-": dict(
        model=cards.with_changes(
            cards.XTX, power_default_w=290, power_min_w=261, power_max_w=333, sclk_max=2219,
            od_boot={"sclk_min": 500, "sclk_max": 2735, "mclk_min": 97, "mclk_max": 1250,
                     "vddgfx_offset": 0}),
        bus=0x03, era="6.14", link=(16.0, 16),
        sensors=dict(busy_pct=3, power_avg_w=68, temp_edge_c=53, temp_junction_c=61, temp_mem_c=68,
                     sclk_mhz=31, mclk_mhz=1249, socclk_mhz=1500, vddgfx_mv=686, fan_rpm=0),
        cap=290, level="auto", writes=[]),
    "rdna3-rx7800xt-powercolor-": dict(
        model=cards.with_changes(
            cards.XTX, device_id=0x747E, subsystem_vendor=0x148C, subsystem_device=0x2427,
            vbios="113-EXT90249-100", power_default_w=236, power_min_w=212, power_max_w=280,
            sclk_min=500, sclk_max=2254, mclk_levels=(96, 456, 772, 1218), socclk_levels=(300, 1500),
            socclk_fine=True, fan_max_rpm=3300,
            pcie_levels=(("2.5GT/s", "x1", 78), ("5.0GT/s", "x4", 156), ("16.0GT/s", "x16", 623)),
            od_boot={"sclk_min": 500, "sclk_max": 2660, "mclk_min": 97, "mclk_max": 1218,
                     "vddgfx_offset": 0}),
        bus=0x03, era="6.14", link=(16.0, 16),
        sensors=dict(busy_pct=2, power_avg_w=32, temp_edge_c=24, temp_junction_c=31, temp_mem_c=48,
                     sclk_mhz=2011, mclk_mhz=456, socclk_mhz=750, vddgfx_mv=985, fan_rpm=868),
        dpm_sclk_mhz=77, cap=236, level="manual",
        writes=[("pp_od_clk_voltage", b"m 1 1300\n"), ("pp_od_clk_voltage", b"vo -100\n"),
                ("pp_od_clk_voltage", b"c\n")]),
    "rdna2-rx6600-": dict(
        model=cards.with_changes(
            cards.RX6800, device_id=0x73FF, subsystem_vendor=0x1458, subsystem_device=0x2334,
            vbios="113-D534-R66E", power_default_w=100, power_min_w=94, power_max_w=120,
            sclk_min=500, sclk_max=2700, mclk_levels=(96, 541, 675, 925), socclk_levels=(417, 1200),
            socclk_fine=True, fan_max_rpm=3100,
            temp_limits=((100000, 105000), (110000, 115000), (100000, 105000)),
            pcie_levels=(("2.5GT/s", "x1", 81), ("8.0GT/s", "x8", 619)),
            od_boot={"sclk_min": 500, "sclk_max": 2700, "mclk_min": 97, "mclk_max": 925,
                     "vddgfx_offset": 0},
            od_ranges={"SCLK": (500, 2900), "MCLK": (674, 950)}),
        bus=0x12, era="6.14", link=(8.0, 8),
        sensors=dict(busy_pct=0, power_avg_w=3, temp_edge_c=28, temp_junction_c=28, temp_mem_c=26,
                     sclk_mhz=20, mclk_mhz=96, socclk_mhz=640, vddgfx_mv=1000, fan_rpm=1395),
        dpm_sclk_mhz=2605, cap=120, level="auto",
        writes=[("pp_od_clk_voltage", b"s 0 2600\n"), ("pp_od_clk_voltage", b"vo -100\n"),
                ("pp_od_clk_voltage", b"c\n")]),
}

# Files the simulator renders that a reference set may contain.
RENDERED_DEVICE = ("current_link_speed", "current_link_width", "gpu_busy_percent",
                   "power_dpm_force_performance_level", "pp_dpm_mclk", "pp_dpm_pcie", "pp_dpm_sclk",
                   "pp_dpm_socclk", "pp_od_clk_voltage", "uevent", "vbios_version")


def build(single_gpu_host, case: dict):
    host = single_gpu_host(case["model"], case["bus"], era=case["era"],
                           root_speed=case["link"][0], root_width=case["link"][1])
    bdf = host.gpus[0]
    g = host.gpu(bdf)
    dev = host.device_path(bdf)
    for name, data in case["writes"]:
        host.write(f"{dev}/{name}", data)
    host.write(f"{host.hwmon_path(bdf)}/power1_cap", f"{case['cap'] * 1_000_000}\n".encode())
    host.write(f"{dev}/power_dpm_force_performance_level", case["level"].encode())
    g.hold_sensors = True
    for k, v in case["sensors"].items():
        setattr(g.sensors, k, v)
    return host, bdf, g


def reference_bytes(path) -> bytes:
    data = path.read_bytes()
    # SOURCES.md: files of exactly 4096 bytes are NUL-padded by the capture, not the kernel.
    if len(data) == 4096:
        data = data.rstrip(b"\0")
    return data


@pytest.mark.parametrize("prefix", sorted(CASES))
def test_every_rendered_file_matches_reference(reference, single_gpu_host, prefix):
    case = CASES[prefix]
    host, bdf, g = build(single_gpu_host, case)
    folder = reference / "amdgpu"
    compared = []
    for ref in sorted(folder.glob(prefix + "*.txt")):
        key = ref.name[len(prefix):-4]
        if key.startswith("hwmon-"):
            path = f"{host.hwmon_path(bdf)}/{key[len('hwmon-'):]}"
        elif key in RENDERED_DEVICE:
            path = f"{host.device_path(bdf)}/{key}"
        else:
            continue      # pp_power_profile_mode, gpu_od/fan_ctrl: not simulated
        if key == "pp_dpm_sclk" and "dpm_sclk_mhz" in case:
            # The reference captured pp_dpm_sclk and freq1_input at different moments.
            g.sensors.sclk_mhz = case["dpm_sclk_mhz"]
            got = host.read(path)
            g.sensors.sclk_mhz = case["sensors"]["sclk_mhz"]
        else:
            got = host.read(path)
        assert got == reference_bytes(ref), f"{prefix}{key}: sim {got!r} != reference"
        compared.append(key)
    # Every kind we render was compared at least once per set that has it.
    assert "pp_od_clk_voltage" in compared and "uevent" in compared and "hwmon-power1_cap" in compared
    assert len(compared) >= 35, compared


def test_rdna4_pre_fix_format_prints_limits_not_setting(reference, single_gpu_host):
    """Kernels before d9d4cb224e41 print the firmware limits under OD_SCLK_OFFSET."""
    model = cards.with_changes(cards.R9700, device_id=0x7550)
    host = single_gpu_host(model, 0x03, era="6.12")
    bdf = host.gpus[0]
    path = f"{host.device_path(bdf)}/pp_od_clk_voltage"
    ref = (reference / "amdgpu" / "rdna4-rx9070xt-powercolor-mar2025-pp_od_clk_voltage.txt").read_bytes()
    assert host.read(path) == ref
    host.write(path, b"s 1 -300\n")            # old syntax accepted ...
    host.write(path, b"c\n")
    assert host.read(path) == ref              # ... and the read-back cannot show it
    assert host.gpu(bdf).od.active["sclk_offset"] == -300


def test_linux66_smu13_vddc_curve_matches_transcription(reference, single_gpu_host):
    """Linux 6.6: OD_VDDC_CURVE with six zone offsets (the reference is hand-typed, so
    compare with whitespace normalised)."""
    model = cards.with_changes(cards.XTX, od_boot={"sclk_min": 500, "sclk_max": 3005, "mclk_min": 97,
                                                   "mclk_max": 1250, "vddgfx_offset": 0})
    host = single_gpu_host(model, 0x03, era="6.6")
    got = host.read(f"{host.device_path(host.gpus[0])}/pp_od_clk_voltage")
    ref = (reference / "amdgpu" / "rdna3-rx7900xtx-linux66-transcribed-pp_od_clk_voltage.txt").read_bytes()
    norm = lambda b: b" ".join(b.replace(b"\0", b" ").split())  # noqa: E731
    assert norm(got) == norm(ref)
    assert b"\0" in got                        # the real 6.6 output has the NUL gaps


def test_kernel_70_has_no_nul_gaps_and_emit_order(single_gpu_host):
    host = single_gpu_host(cards.R9700, 0x03, era="7.0")
    got = host.read(f"{host.device_path(host.gpus[0])}/pp_od_clk_voltage")
    assert b"\0" not in got
    assert got.index(b"OD_RANGE:") < got.index(b"OD_VDDGFX_OFFSET:")


def test_incident_host_ids_links_and_bar(incident):
    h = incident
    xtx = h.device_path("aa:00.0")
    assert h.read(f"{xtx}/device") == b"0x744c\n"
    assert h.read(f"{xtx}/class") == b"0x030000\n"
    lines = h.read(f"{xtx}/resource").decode().splitlines()
    assert len(lines) == 13
    start, end, flags = (int(x, 16) for x in lines[0].split())
    assert end - start + 1 == 256 << 20
    assert h.read(f"{xtx}/mem_info_vis_vram_total") == b"268435456\n"
    r = h.device_path("05:00.0")
    start, end, _ = (int(x, 16) for x in h.read(f"{r}/resource").decode().splitlines()[0].split())
    assert end - start + 1 == 32 << 30
    assert h.read(f"{r}/mem_info_vis_vram_total") == h.read(f"{r}/mem_info_vram_total") == b"34208743424\n"
    bridge_lines = h.read("/sys/bus/pci/devices/0000:a7:00.0/resource").decode().splitlines()
    assert len(bridge_lines) == 17
