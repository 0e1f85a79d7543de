"""Static descriptions of the simulated GPU models and of kernel eras.

Owns: what is fixed for a card model (PCI ids, VRAM/BAR, DPM tables, OD table and ranges,
power-cap limits, thermal limits, load-model constants) and what is fixed for a kernel
version (`KernelEra`: NUL gaps in pp_od_clk_voltage, RDNA4 OD format, errno for reads of
a sleeping/resetting GPU). Numbers come from INCIDENTS §1–§5 and the reference dumps;
where neither gives one, the value is a realistic choice and says so.
"""
from __future__ import annotations

import errno
from dataclasses import dataclass, replace

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class KernelEra:
    """What changes between kernel versions for the same card (amdgpu-od-protocol.md)."""

    name: str
    nul_gaps: bool               # print_clock_levels fallback leaves NUL runs (≤ 6.14)
    smu13_vddc_curve: bool       # Linux 6.6: SMU13 OD_VDDC_CURVE + `vc`, no `vo`
    smu14_fixed_format: bool     # upstream d9d4cb224e41: `s <offset>`, OD_SCLK_OFFSET: %dMhz
    suspended_read: str          # "wake" (K611) | "EPERM" (2025 patches) | "EBUSY" (K70)
    busy_errno: int              # reset in progress / system suspend
    level_prefix_match: bool     # power_dpm_force_performance_level: strncmp vs sysfs_streq

    @property
    def suspended_read_errno(self) -> int | None:
        return {"wake": None, "EPERM": errno.EPERM, "EBUSY": errno.EBUSY}[self.suspended_read]


ERA_6_6 = KernelEra("6.6", True, True, False, "wake", errno.EPERM, True)
ERA_6_12 = KernelEra("6.12", True, False, False, "wake", errno.EPERM, True)   # before the RDNA4 fix
ERA_6_14 = KernelEra("6.14", True, False, True, "EPERM", errno.EPERM, True)   # may2025 captures
ERA_7_0 = KernelEra("7.0", False, False, True, "EBUSY", errno.EBUSY, False)
ERAS = {e.name: e for e in (ERA_6_6, ERA_6_12, ERA_6_14, ERA_7_0)}


@dataclass(frozen=True)
class LoadParams:
    """Constants of the load model (see load.py for the formulas and their calibration)."""

    idle_w: float
    mem_w: float                 # memory/fabric power at full load
    k_dyn: float                 # W per (MHz · V²) of SCLK power at full load
    v_ref: float                 # V at the reference load clock
    f_ref: float                 # MHz the card runs under full load at stock settings
    v_per_mhz: float             # V/MHz slope of the V/F curve
    v_idle: float                # V at idle
    sclk_idle: int               # deep-sleep SCLK at idle
    load_slope: float = 1.0      # MHz under load per MHz of SCLK limit (SMU13 sclk_max)
    r_edge: float = 0.095        # °C/W edge over ambient
    r_junction: float = 0.10     # °C/W junction over edge
    mem_base_c: float = 48.0
    mem_per_load_c: float = 22.0


@dataclass(frozen=True)
class CardModel:
    name: str
    device_id: int
    subsystem_vendor: int
    subsystem_device: int
    revision: int
    gfx: str
    od_family: str               # "smu14" | "smu13" | "navi2x"
    vram_total: int
    bar0_size: int
    vbios: str
    link_gen: str                # card's own max link speed ("16.0 GT/s PCIe")
    internal_link: str           # what the 1479 bridge and the GPU endpoint report
    od_boot: dict
    od_ranges: dict
    power_default_w: int
    power_min_w: int
    power_max_w: int
    sclk_min: int                # lowest DPM SCLK (pp_dpm_sclk level 0)
    sclk_max: int                # highest DPM SCLK (last level)
    sclk_fine: bool              # fine-grained: "0: min / 1: cur * / 2: max"
    mclk_levels: tuple
    mclk_fine: bool
    socclk_levels: tuple
    socclk_fine: bool
    fclk_levels: tuple
    fclk_fine: bool
    pcie_levels: tuple           # ((gen "16.0GT/s", width "x16", MHz), ...); every level whose
                                 # gen/width equal the current link is marked (both SMU13 and SMU14)
    temp_limits: tuple           # ((crit, emergency) mC) for edge, junction, mem
    fan_max_rpm: int
    load: LoadParams
    has_power_input: bool = False
    has_power_average: bool = True


# Radeon AI PRO R9700 (Navi48, gfx1201). INCIDENTS §2/§5; formats as the RX 9070 XT
# (same ASIC, SMU 14.0.2). Subsystem and VBIOS strings are realistic inventions.
R9700 = CardModel(
    name="Radeon AI PRO R9700",
    device_id=0x7551, subsystem_vendor=0x1002, subsystem_device=0x0E56, revision=0xC0,
    gfx="gfx1201", od_family="smu14",
    vram_total=34208743424,           # INCIDENTS §5: 34208743424 / vis=34208743424
    bar0_size=32 * GIB,               # INCIDENTS §5: BAR=32768M
    vbios="113-APM7551-100",
    link_gen="32.0 GT/s PCIe", internal_link="32.0 GT/s PCIe",
    od_boot={"sclk_offset": 0, "mclk_min": 97, "mclk_max": 1259, "vddgfx_offset": 0},
    od_ranges={"SCLK_OFFSET": (-500, 1000), "MCLK": (97, 1500), "VDDGFX_OFFSET": (-200, 0)},
    power_default_w=300, power_min_w=210, power_max_w=300,     # INCIDENTS §2: floor 210 W
    sclk_min=500, sclk_max=2920, sclk_fine=True,
    mclk_levels=(96, 456, 772, 875, 1124, 1258), mclk_fine=False,
    socclk_levels=(417, 1280, 1476), socclk_fine=True,
    fclk_levels=(400, 1400, 2000), fclk_fine=True,
    pcie_levels=(("2.5GT/s", "x16", 250), ("16.0GT/s", "x16", 1143)),
    temp_limits=((110000, 115000), (110000, 115000), (108000, 113000)),
    fan_max_rpm=3650,
    # Calibrated so that full load at stock averages 182 W and -500 MHz/-100 mV gives
    # ~129 W (INCIDENTS §2).
    load=LoadParams(idle_w=25.0, mem_w=40.0, k_dyn=0.04516, v_ref=1.05, f_ref=2350.0,
                    v_per_mhz=0.00015, v_idle=0.552, sclk_idle=16),
)

# Radeon RX 7900 XTX (Navi31, gfx1100), reference-board power limits (INCIDENTS §1: cap
# 355 W); min = default × 0.9 (SMU13 rule, amdgpu-od-protocol.md §4), max = +13 % OD.
XTX = CardModel(
    name="Radeon RX 7900 XTX",
    device_id=0x744C, subsystem_vendor=0x1DA2, subsystem_device=0xE471, revision=0xC8,
    gfx="gfx1100", od_family="smu13",
    vram_total=25753026560,           # 24 GiB minus firmware reservations, as amdgpu reports
    bar0_size=256 * MIB,              # INCIDENTS §5: the VBIOS asked for a 256 MB BAR
    vbios="113-D70401XT-N11",
    link_gen="16.0 GT/s PCIe", internal_link="16.0 GT/s PCIe",
    od_boot={"sclk_min": 500, "sclk_max": 2500, "mclk_min": 97, "mclk_max": 1250, "vddgfx_offset": 0},
    od_ranges={"SCLK": (500, 5000), "MCLK": (97, 1500), "VDDGFX_OFFSET": (-450, 0)},
    power_default_w=355, power_min_w=319, power_max_w=402,
    sclk_min=500, sclk_max=2500, sclk_fine=True,
    mclk_levels=(96, 456, 772, 1249), mclk_fine=False,
    socclk_levels=(500, 1500), socclk_fine=False,
    fclk_levels=(800, 1900, 2500), fclk_fine=False,
    pcie_levels=(("16.0GT/s", "x16", 78), ("16.0GT/s", "x16", 156), ("16.0GT/s", "x16", 623)),
    temp_limits=((100000, 105000), (110000, 115000), (108000, 113000)),
    fan_max_rpm=3200,
    # INCIDENTS §3: stock 2371 MHz under load; SCLK max 1500 → ~1233 MHz; 2000/-100 mV
    # → ~1800 MHz (the -31 % job time). load_slope = (2371-1233)/(2500-1500).
    load=LoadParams(idle_w=25.0, mem_w=30.0, k_dyn=0.100, v_ref=1.10, f_ref=2371.0,
                    v_per_mhz=0.00015, v_idle=0.686, sclk_idle=31, load_slope=1.138),
)

# Radeon RX 6800 (Navi21) for the Navi2x OD behaviour; values as the reference dump.
RX6800 = CardModel(
    name="Radeon RX 6800",
    device_id=0x73BF, subsystem_vendor=0x1002, subsystem_device=0x0E3A, revision=0xC3,
    gfx="gfx1030", od_family="navi2x",
    vram_total=17163091968, bar0_size=16 * GIB, vbios="113-D4120100-100",
    link_gen="16.0 GT/s PCIe", internal_link="16.0 GT/s PCIe",
    od_boot={"sclk_min": 500, "sclk_max": 2314, "mclk_min": 97, "mclk_max": 1000, "vddgfx_offset": 0},
    od_ranges={"SCLK": (500, 2600), "MCLK": (674, 1075)},
    power_default_w=203, power_min_w=0, power_max_w=203,
    sclk_min=500, sclk_max=2314, sclk_fine=True,
    mclk_levels=(96, 456, 673, 1000), mclk_fine=False,
    socclk_levels=(500, 1200), socclk_fine=False,
    fclk_levels=(500, 1940), fclk_fine=False,
    pcie_levels=(("2.5GT/s", "x1", 310), ("16.0GT/s", "x16", 619)),
    temp_limits=((100000, 105000), (110000, 115000), (100000, 105000)),
    fan_max_rpm=3300,
    load=LoadParams(idle_w=8.0, mem_w=30.0, k_dyn=0.06, v_ref=1.025, f_ref=2200.0,
                    v_per_mhz=0.0002, v_idle=0.7, sclk_idle=0),
)

MODELS = {"r9700": R9700, "xtx": XTX, "rx6800": RX6800}


def with_changes(model: CardModel, **changes) -> CardModel:
    """A variant of a model (tests build reference-identical cards this way)."""
    return replace(model, **changes)
