"""NVIDIA profiles through NVML: what owners do by hand at boot (`nvidia-smi -pl`, `-lgc`,
`-lmc`), with the same plan → apply one card at a time → read back → retry → report path
and the same `CardResult` (and so the same `gpuguard apply` table and events) as amdgpu.

A profile's settings map onto NVML as:
  power_cap_w                 nvmlDeviceSetPowerManagementLimit (mW), within
                              nvmlDeviceGetPowerManagementLimitConstraints; read back
                              nvmlDeviceGetEnforcedPowerLimit (another limit — a host or
                              board cap — can hold the enforced value lower: unverified)
  sclk_min_mhz/sclk_max_mhz   nvmlDeviceSetGpuLockedClocks, within the supported graphics
                              clocks; read back: the graphics clock lies in the range (a
                              clock held below it names the clock-event reason, e.g.
                              sw_power_cap, instead of passing silently)
  mclk_max_mhz                nvmlDeviceSetMemoryLockedClocks(lowest supported, max)
Reset: nvmlDeviceResetGpuLockedClocks, nvmlDeviceResetMemoryLockedClocks and the default
power limit. Settings NVML has no equivalent for (voltage and clock offsets,
performance_level) are refused before anything is written.

A driver that refuses (not root: NoPermission; a VM or a consumer card: NotSupported)
makes the card "unverified" with NVML's own reason; the other cards are still applied.
Never run against the lent H200 (read-only there); tests use a fake NVML that enforces
NVML's rules (tests/nvml/fake_nvml.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from gpuguard.hw import nvml_calls as C
from gpuguard.hw.nvml import normalise_bus_id
from gpuguard.hw.nvml_health import decode_reasons
from gpuguard.profiles.apply import CardResult
from gpuguard.profiles.schema import Profile
from gpuguard.profiles.wait import wait_for_gpus

log = logging.getLogger("gpuguard.profiles.nvidia")

REFUSING = ("NVMLError_NoPermission", "NVMLError_NotSupported", "NVMLError_FunctionNotFound")
TRANSIENT = ("NVMLError_InUse", "NVMLError_Timeout", "NVMLError_Unknown")
LOST = ("NVMLError_GpuIsLost",)
UNMAPPED = ("sclk_offset_mhz", "vddgfx_offset_mv")


@dataclass(frozen=True)
class NvmlLimits:
    """The card's own constraints, as NVML states them (milliwatts, MHz)."""

    power_min_mw: int | None
    power_max_mw: int | None
    power_default_mw: int | None
    graphics_clocks: tuple[int, ...]
    memory_clocks: tuple[int, ...]


@dataclass(frozen=True)
class NvmlOp:
    call: str
    args: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.call}({', '.join(str(a) for a in self.args)})"


@dataclass(frozen=True)
class NvmlPlan:
    profile: str
    ops: tuple[NvmlOp, ...]
    # setting -> what the read-back must show: power_cap_w in W; sclk_locked_mhz and
    # mclk_locked_mhz as "min-max" (the clock now must lie inside)
    expected: Mapping[str, Any] = field(default_factory=dict)


class NvmlPlanError(Exception):
    def __init__(self, kind: str, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.kind = kind
        self.problems = problems


def _name(e: BaseException) -> str:
    return type(e).__name__


def plan_apply(card: str, profile_name: str, profile: Profile, lim: NvmlLimits) -> NvmlPlan:
    """Validate against the card's constraints; a refusal means nothing is written."""
    unmapped = [k for k in UNMAPPED if getattr(profile, k) is not None]
    if profile.performance_level is not None:
        unmapped.append("performance_level")
    if unmapped:
        raise NvmlPlanError("config", [f"{card}: {', '.join(unmapped)} has no NVML equivalent on an NVIDIA card; "
                                       "remove it from the profile (nothing written)"])
    problems: list[str] = []
    ops: list[NvmlOp] = []
    expected: dict[str, Any] = {}
    env = profile.envelope
    if profile.power_cap_w is not None:
        mw = profile.power_cap_w * 1000
        if lim.power_min_mw is None or lim.power_max_mw is None:
            problems.append(f"{card}: power_cap_w: the driver states no power limit constraints (NotSupported)")
        elif not lim.power_min_mw <= mw <= lim.power_max_mw:
            problems.append(f"{card}: power_cap_w {profile.power_cap_w} outside the card's "
                            f"{lim.power_min_mw // 1000}-{lim.power_max_mw // 1000} W "
                            "(nvmlDeviceGetPowerManagementLimitConstraints)")
        ops.append(NvmlOp("nvmlDeviceSetPowerManagementLimit", (mw,)))
        expected["power_cap_w"] = profile.power_cap_w
    if profile.sclk_min_mhz is not None or profile.sclk_max_mhz is not None:
        if not lim.graphics_clocks:
            problems.append(f"{card}: sclk range: the driver lists no supported graphics clocks")
        else:
            lo = profile.sclk_min_mhz if profile.sclk_min_mhz is not None else min(lim.graphics_clocks)
            hi = profile.sclk_max_mhz if profile.sclk_max_mhz is not None else max(lim.graphics_clocks)
            g_lo, g_hi = min(lim.graphics_clocks), max(lim.graphics_clocks)
            for key, v in (("sclk_min_mhz", lo), ("sclk_max_mhz", hi)):
                if not g_lo <= v <= g_hi:
                    problems.append(f"{card}: {key} {v} outside the card's supported graphics clocks {g_lo}-{g_hi} MHz")
            if lo > hi:
                problems.append(f"{card}: sclk_min_mhz {lo} is above sclk_max_mhz {hi}")
            ops.append(NvmlOp("nvmlDeviceSetGpuLockedClocks", (lo, hi)))
            expected["sclk_locked_mhz"] = f"{lo}-{hi}"
    if profile.mclk_max_mhz is not None:
        if not lim.memory_clocks:
            problems.append(f"{card}: mclk_max_mhz: the driver lists no supported memory clocks")
        else:
            m_lo, m_hi = min(lim.memory_clocks), max(lim.memory_clocks)
            if not m_lo <= profile.mclk_max_mhz <= m_hi:
                problems.append(f"{card}: mclk_max_mhz {profile.mclk_max_mhz} outside the card's supported memory "
                                f"clocks {m_lo}-{m_hi} MHz ({', '.join(map(str, sorted(lim.memory_clocks)))})")
            ops.append(NvmlOp("nvmlDeviceSetMemoryLockedClocks", (m_lo, profile.mclk_max_mhz)))
            expected["mclk_locked_mhz"] = f"{m_lo}-{profile.mclk_max_mhz}"
    for setting, b in env.items():
        v = profile.values().get(setting)
        if v is not None and ((b.min is not None and v < b.min) or (b.max is not None and v > b.max)):
            problems.append(f"{card}: {setting} {v} outside the profile's envelope {b.min}-{b.max}")
    if problems:
        raise NvmlPlanError("refused", problems)
    return NvmlPlan(profile_name, tuple(ops), expected)


def plan_reset(lim: NvmlLimits) -> NvmlPlan:
    ops = [NvmlOp("nvmlDeviceResetGpuLockedClocks", ()), NvmlOp("nvmlDeviceResetMemoryLockedClocks", ())]
    expected: dict[str, Any] = {}
    if lim.power_default_mw is not None:
        ops.append(NvmlOp("nvmlDeviceSetPowerManagementLimit", (lim.power_default_mw,)))
        expected["power_cap_w"] = lim.power_default_mw // 1000
    return NvmlPlan("stock", tuple(ops), expected)


class NvmlApplier:
    def __init__(self, nvml: Any, audit: Callable[[dict], None] | None = None, retries: int = 3,
                 backoff: float = 0.5, sleep: Callable[[float], None] = time.sleep,
                 is_lost: Callable[[str], bool] = lambda bdf: False) -> None:
        self.nvml = nvml
        self.audit = audit or (lambda rec: None)
        self.retries = retries
        self.backoff = backoff
        self.sleep = sleep
        self.is_lost = is_lost

    # -- reading ------------------------------------------------------------------------
    def limits(self, h: Any) -> NvmlLimits:
        n = self.nvml

        def get(fn: Callable[[], Any], default: Any = None) -> Any:
            try:
                return fn()
            except Exception as e:
                if _name(e) in LOST:
                    raise
                return default

        cons = get(lambda: n.nvmlDeviceGetPowerManagementLimitConstraints(h))
        mem = tuple(int(x) for x in get(lambda: n.nvmlDeviceGetSupportedMemoryClocks(h), ()) or ())
        gfx = tuple(int(x) for x in (get(lambda: n.nvmlDeviceGetSupportedGraphicsClocks(h, max(mem)), ()) if mem else ()) or ())
        default = get(lambda: n.nvmlDeviceGetPowerManagementDefaultLimit(h))
        return NvmlLimits(None if cons is None else int(cons[0]), None if cons is None else int(cons[1]),
                          None if default is None else int(default), gfx, mem)

    def observe(self, h: Any, expected: Mapping[str, Any]) -> dict[str, Any]:
        """The read-back, in the plan's terms (see NvmlPlan.expected)."""
        n = self.nvml
        out: dict[str, Any] = {}
        try:
            out["power_cap_w"] = int(n.nvmlDeviceGetEnforcedPowerLimit(h)) // 1000
        except Exception as e:
            if _name(e) in LOST:
                raise
            out["power_cap_w"] = None
        reasons: list[str] = []
        try:
            reasons = decode_reasons(int(n.nvmlDeviceGetCurrentClocksEventReasons(h)))
        except Exception:
            pass
        for key, clock in (("sclk_locked_mhz", C.CLOCK_GRAPHICS), ("mclk_locked_mhz", C.CLOCK_MEM)):
            if key not in expected:
                continue
            try:
                now = int(n.nvmlDeviceGetClockInfo(h, clock))
            except Exception as e:
                if _name(e) in LOST:
                    raise
                out[key] = None
                continue
            lo, hi = (int(x) for x in str(expected[key]).split("-"))
            if lo <= now <= hi:
                out[key] = expected[key]  # the clock is inside the locked range
            else:
                held = [r for r in reasons if r != "gpu_idle"]
                out[key] = f"{now} now" + (f" ({', '.join(held)})" if held else "")
        if reasons:
            out["clock_event_reasons"] = ",".join(reasons)
        return out

    # -- the sequence ---------------------------------------------------------------------
    def apply(self, index: int, gpu: str, bdf: str, profile_name: str, profile: Profile, who: str, why: str,
              dry_run: bool = False) -> CardResult:
        return self._run(index, gpu, bdf, profile_name,
                         lambda lim: plan_apply(gpu, profile_name, profile, lim), who, why, dry_run)

    def reset(self, index: int, gpu: str, bdf: str, who: str, why: str, dry_run: bool = False) -> CardResult:
        return self._run(index, gpu, bdf, "stock", plan_reset, who, why, dry_run)

    def _run(self, index: int, gpu: str, bdf: str, profile_name: str, make_plan: Callable[[NvmlLimits], NvmlPlan],
             who: str, why: str, dry_run: bool) -> CardResult:
        base = dict(gpu=gpu, bdf=bdf, profile=profile_name)
        if self.is_lost(bdf):
            return CardResult(**base, result="lost", verified=False, message=f"{gpu} ({bdf}) is lost; nothing written")
        n = self.nvml
        try:
            h = n.nvmlDeviceGetHandleByIndex(index)
            # NVML's indices follow the PCI order of the cards present now: a card that
            # appeared (or left) since the index was taken moves the others. Never write
            # the card next door (INCIDENTS §2: the glob matched one card).
            pci = n.nvmlDeviceGetPciInfo(h)
            at = normalise_bus_id(getattr(pci, "busIdLegacy", None) or pci.busId)
            if at != bdf:
                return CardResult(**base, result="error", verified=False,
                                  message=f"NVML device {index} is {at} now, not {bdf}; nothing written")
            lim = self.limits(h)
            try:
                plan = make_plan(lim)
            except NvmlPlanError as e:
                return CardResult(**base, result=e.kind, verified=False, message="; ".join(e.problems),
                                  errors=tuple(e.problems))
            before = self.observe(h, plan.expected)
        except Exception as e:
            kind = "lost" if _name(e) in LOST else "error"
            return CardResult(**base, result=kind, verified=False, message=f"NVML {_name(e)}: {e}")
        planned = tuple(str(op) for op in plan.ops)
        if dry_run:
            return CardResult(**base, result="dry-run", verified=False, before=before, planned=planned,
                              expected=plan.expected, message="dry run: nothing written")
        return self._execute(h, base, plan, before, who, why)

    def _execute(self, h: Any, base: dict, plan: NvmlPlan, before: Mapping[str, Any], who: str, why: str) -> CardResult:
        base = dict(base, before=before, planned=tuple(str(op) for op in plan.ops), expected=plan.expected)
        written: list[str] = []
        errors: list[str] = []
        readback: dict[str, Any] = {}
        attempts = 0
        for attempt in range(self.retries + 1):
            attempts = attempt + 1
            if attempt:
                self.sleep(self.backoff * (2 ** (attempt - 1)))
            if self.is_lost(base["bdf"]):
                return CardResult(**base, result="lost", verified=False, written=tuple(written), attempts=attempts,
                                  errors=tuple(errors), message="GPU lost during apply; writing stopped")
            failed: BaseException | None = None
            for op in plan.ops:
                rec = {"action": "write", "who": who, "why": why, "gpu": base["gpu"], "bdf": base["bdf"],
                       "nvml": str(op)}
                try:
                    getattr(self.nvml, op.call)(h, *op.args)
                except Exception as e:
                    failed = e
                    errors.append(f"{op}: {_name(e)}: {e}")
                    self.audit({**rec, "result": "error", "error": errors[-1]})
                    break
                self.audit({**rec, "result": "ok"})
                written.append(str(op))
            if failed is not None:
                en = _name(failed)
                if en in LOST:
                    return CardResult(**base, result="lost", verified=False, written=tuple(written), attempts=attempts,
                                      errors=tuple(errors), message=errors[-1])
                if en in TRANSIENT:
                    continue
                # NoPermission / NotSupported (not root, a VM): the driver refuses; retrying
                # the same call will not change its mind. InvalidArgument after our own
                # validation: the driver knows a constraint we were not told; stop too.
                result = "refused" if en in REFUSING else "error"
                try:
                    readback = self.observe(h, plan.expected)
                except Exception:
                    readback = {}
                return CardResult(**base, result=result, verified=False, written=tuple(written), readback=readback,
                                  attempts=attempts, errors=tuple(errors),
                                  message=f"the driver refused: {errors[-1]}")
            try:
                readback = self.observe(h, plan.expected)
            except Exception as e:
                return CardResult(**base, result="lost", verified=False, written=tuple(written), attempts=attempts,
                                  errors=tuple(errors) + (f"read back: {_name(e)}",), message=f"read back: {_name(e)}")
            bad = {k: (v, readback.get(k)) for k, v in plan.expected.items() if readback.get(k) != v}
            if not bad:
                self.audit({"action": "verified", "who": who, "why": why, "gpu": base["gpu"], "bdf": base["bdf"],
                            "profile": plan.profile, "readback": readback, "attempts": attempts})
                return CardResult(**base, result="ok", verified=True, written=tuple(written), readback=readback,
                                  attempts=attempts, errors=tuple(errors),
                                  message=f"read back equal after {attempts} attempt(s)")
            errors.append("read back differs: " + ", ".join(
                f"{k} wrote {exp} read {got if got is not None else '?'}" for k, (exp, got) in bad.items()))
            log.warning("gpu=%s attempt %d: %s", base["gpu"], attempts, errors[-1])
        msg = f"still wrong after {attempts} attempt(s): {errors[-1] if errors else 'unknown'}"
        self.audit({"action": "unverified", "who": who, "why": why, "gpu": base["gpu"], "bdf": base["bdf"],
                    "profile": plan.profile, "readback": readback, "reason": msg})
        return CardResult(**base, result="mismatch", verified=False, written=tuple(written), readback=readback,
                          attempts=attempts, errors=tuple(errors), message=msg)


async def apply_all(applier: NvmlApplier, discover: Callable[[], Iterable[Any]], assignments: Mapping[str, str],
                    profiles: Mapping[str, Profile], name_for: Callable[[Any], str], who: str, why: str,
                    wanted: int = 0, timeout: float = 120.0, interval: float = 0.25) -> list[CardResult]:
    """Wait until `wanted` NVIDIA GPUs are present (INCIDENTS §2: the boot service ran
    before the second card existed), then apply each assigned card, one at a time, in
    PCI order. A card that refuses does not stop the others."""
    loop = asyncio.get_running_loop()
    devices: list[Any] = []

    async def look() -> tuple[list[str], list[str]]:
        nonlocal devices
        devices = list(await loop.run_in_executor(None, lambda: list(discover())))
        present = [name_for(d) for d in devices]
        return present, [g for g in assignments if g not in present]

    if wanted:
        w = await wait_for_gpus(look, wanted, timeout, interval)
        if not w.complete:
            log.warning("nvidia profiles: %s", w.message())
    else:
        await look()
    out = []
    for d in sorted(devices, key=lambda d: d.bdf):
        gpu = name_for(d)
        prof = assignments.get(gpu)
        if prof is None:
            continue
        out.append(await loop.run_in_executor(
            None, lambda d=d, gpu=gpu, prof=prof: applier.apply(d.index, gpu, d.bdf, prof, profiles[prof], who, why)))
    return out


class VendorApplier:
    """`profiles.apply.Applier`'s apply/reset for a mixed host: NVIDIA cards (by PCI
    address) go through NVML, every other card to the amdgpu applier. Same CardResult,
    so `gpuguard apply` prints one table for both and the daemon keeps one ledger.

    With `discover` (the daemon: NVML's own discovery), the NVIDIA list is taken again
    for every card operation: a card that appeared late is found, and an index that moved
    with it is never used."""

    def __init__(self, amd: Any, nvml_applier: NvmlApplier, nvidia_devices: Iterable[Any] = (),
                 discover: Callable[[], Iterable[Any]] | None = None) -> None:
        self.amd = amd
        self.nv = nvml_applier
        self.devices = {d.bdf: d for d in nvidia_devices}
        self.discover = discover

    # the daemon's reload sets these once for both vendors
    @property
    def retries(self) -> int:
        return self.nv.retries

    @retries.setter
    def retries(self, n: int) -> None:
        self.nv.retries = self.amd.retries = n

    @property
    def backoff(self) -> float:
        return self.nv.backoff

    @backoff.setter
    def backoff(self, s: float) -> None:
        self.nv.backoff = self.amd.backoff = s

    def _nvidia(self, bdf: str) -> Any | None:
        if self.discover is not None:
            try:
                self.devices = {d.bdf: d for d in self.discover()}
            except Exception as e:  # NVML down: the cards it listed before are still NVIDIA's
                log.warning("NVML discovery for %s failed: %s: %s", bdf, _name(e), e)
        return self.devices.get(bdf)

    def apply(self, target: Any, profile_name: str, profile: Profile, who: str, why: str,
              dry_run: bool = False) -> CardResult:
        d = self._nvidia(target.bdf)
        if d is None:
            return self.amd.apply(target, profile_name, profile, who, why, dry_run)
        return self.nv.apply(d.index, target.name, target.bdf, profile_name, profile, who, why, dry_run)

    def reset(self, target: Any, who: str, why: str, dry_run: bool = False) -> CardResult:
        d = self._nvidia(target.bdf)
        if d is None:
            return self.amd.reset(target, who, why, dry_run)
        return self.nv.reset(d.index, target.name, target.bdf, who, why, dry_run)

    def read(self, target: Any) -> Any:
        """What the confirm window keeps to revert to. NVML cannot read locked clocks back
        (there is no getter), so a revert could not be verified: refused, by name."""
        if self._nvidia(target.bdf) is None:
            return self.amd.read(target)
        raise NvmlRevertUnsupported(
            f"{target.name} ({target.bdf}) is an NVIDIA card: NVML has no read-back of locked clocks, so the state "
            "before cannot be restored and verified; apply without confirm_within (reset restores the defaults)")


class NvmlRevertUnsupported(Exception):
    pass


def host_nvidia(root: str, audit: Callable[[dict], None] | None = None, retries: int = 3,
                backoff: float = 0.5) -> tuple[list[Any], NvmlApplier | None]:
    """The host's NVIDIA GPUs and an applier for them: only on the real root (`/`) with
    nvidia-ml-py and a driver present; otherwise ([], None) — a simulated tree has no NVML."""
    if root != "/":
        return [], None
    from gpuguard.hw.nvml import NvmlSource

    src = NvmlSource.open()
    if src is None:
        return [], None
    try:
        devices = src.discover()
    except Exception as e:
        log.warning("NVIDIA GPUs not listed: NVML discovery failed: %s: %s", _name(e), e)
        return [], None
    return devices, NvmlApplier(src.nvml, audit=audit, retries=retries, backoff=backoff)
