"""Putting a profile on one card and proving it: write, read back, compare, retry.

Owns the per-card apply sequence (amdgpu-od-protocol §6):
1. refuse a lost GPU; read the card (OD table, power1_cap limits) without waking it;
2. plan + validate (plan.py) — a refusal means nothing at all is written;
3. keep the card awake (`power/control` = `on`) while writing, restore it afterwards
   (LACT #1057: OD apply at boot fails on a runtime-suspended headless R9700);
4. write each command as its own `write()`; EINVAL's reason comes from the kernel log;
5. read back every value and compare; mismatch ⇒ retry with backoff (doubling);
   still wrong ⇒ unverified (an alert-grade event from `result_event`), nothing else touched.
"Applied" means read back equal (DESIGN.md). Every write goes to the audit log with who
asked and why. Callers run this in a worker thread: it blocks.
"""
from __future__ import annotations

import errno as errno_mod
import logging
import os
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from gpuguard.hw.sysfs import SysfsError, SysfsRoot
from gpuguard.profiles.plan import (
    CAP_FILE,
    LEVEL_FILE,
    OD_FILE,
    CapLimits,
    Plan,
    PlanError,
    mismatches,
    observed_values,
    plan_apply,
    plan_reset,
)
from gpuguard.profiles.schema import Profile
from gpuguard.state.events import Event
from gpuguard.state.snapshot import OdState

log = logging.getLogger("gpuguard.profiles")

PCI_DEVICES = "/sys/bus/pci/devices"
TRANSIENT = frozenset({errno_mod.EPERM, errno_mod.EBUSY, errno_mod.EAGAIN})  # asleep / resetting
GONE = frozenset({errno_mod.ENODEV, errno_mod.ENOENT, errno_mod.ENXIO})
# result -> the `result` label of gpuguard_profile_apply_total (METRICS.md)
METRIC_RESULT = {"ok": "ok", "mismatch": "mismatch", "error": "error", "lost": "error",
                 "refused": "refused", "config": "refused", "od_disabled": "refused"}


@dataclass(frozen=True)
class CardTarget:
    name: str
    bdf: str

    @property
    def device(self) -> str:
        return f"{PCI_DEVICES}/{self.bdf}"


@dataclass(frozen=True)
class CardReading:
    od: OdState | None
    od_missing: str | None  # no pp_od_clk_voltage: why, with the kernel parameter to add
    od_error: str | None  # the file is there but could not be read or parsed
    cap: CapLimits | None
    cap_error: str | None
    performance_level: str | None
    runtime_status: str | None
    transient: bool  # a read failed with EPERM/EBUSY: asleep or resetting

    def values(self) -> dict[str, int | str]:
        out: dict[str, int | str] = dict(observed_values(self.od, self.cap.current_uw if self.cap else None))
        if self.performance_level is not None:
            out["performance_level"] = self.performance_level
        return out


@dataclass(frozen=True)
class CardResult:
    """One card's apply (or reset) outcome. `result`: ok, mismatch, error, lost, refused,
    config, od_disabled, dry-run. `verified` is True only when every value read back equal."""

    gpu: str
    bdf: str
    profile: str
    result: str
    verified: bool
    message: str
    before: Mapping[str, Any] = field(default_factory=dict)
    planned: tuple[str, ...] = ()
    written: tuple[str, ...] = ()
    readback: Mapping[str, Any] = field(default_factory=dict)
    expected: Mapping[str, Any] = field(default_factory=dict)
    attempts: int = 0
    errors: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for k in ("before", "readback", "expected"):
            object.__setattr__(self, k, MappingProxyType(dict(getattr(self, k))))

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu, "bdf": self.bdf, "profile": self.profile, "result": self.result,
            "verified": self.verified, "message": self.message, "before": dict(self.before),
            "planned": list(self.planned), "written": list(self.written), "readback": dict(self.readback),
            "expected": dict(self.expected), "attempts": self.attempts, "errors": list(self.errors),
        }


def result_event(r: CardResult, source: str = "profiles") -> Event | None:
    """The event an apply result raises: info when verified, alert when not."""
    if r.result == "dry-run":
        return None
    if r.verified:
        return Event("profile_applied", "info", source, f"profile {r.profile} on {r.gpu} ({r.bdf}) read back equal "
                     f"after {r.attempts} attempt(s)", gpu=r.gpu, bdf=r.bdf, fields={"profile": r.profile})
    return Event("profile_unverified", "alert", source, f"profile {r.profile} on {r.gpu} ({r.bdf}) NOT verified "
                 f"({r.result}): {r.message}", gpu=r.gpu, bdf=r.bdf,
                 fields={"profile": r.profile, "result": r.result, "errors": list(r.errors)})


def _errno_text(err: int) -> str:
    return f"{errno_mod.errorcode.get(err, str(err))} ({os.strerror(err)})"


class Applier:
    def __init__(
        self,
        root: SysfsRoot,
        audit: Callable[[dict], None] | None = None,
        kernel_reason: Callable[[str, Any], str | None] | None = None,
        retries: int = 3,
        backoff: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
        is_lost: Callable[[str], bool] = lambda bdf: False,
        wake_timeout: float = 2.0,
        may_write: Callable[[str], bool] = lambda bdf: True,
    ) -> None:
        self.root = root
        self.audit = audit or (lambda rec: None)
        if kernel_reason is None:
            from gpuguard.profiles.kernel_reason import KmsgReasons

            kernel_reason = KmsgReasons(root)
        self.kernel_reason = kernel_reason
        self.retries = retries
        self.backoff = backoff
        self.sleep = sleep
        self.is_lost = is_lost
        # asked before every single write (the GPU state owner: lost, not answering,
        # unnamed, the daemon stopping); a refusal ends the apply, nothing more is written
        self.may_write = may_write
        self.wake_timeout = wake_timeout

    # -- reading ------------------------------------------------------------------------
    def hwmon(self, target: CardTarget) -> str | None:
        """Today's amdgpu hwmon folder (its number changes between boots: look it up each time)."""
        base = f"{target.device}/hwmon"
        for entry in self.root.listdir(base):
            try:
                if self.root.read_text(f"{base}/{entry}/name") == "amdgpu":
                    return f"{base}/{entry}"
            except SysfsError:
                continue
        return None

    def read(self, target: CardTarget) -> CardReading:
        from gpuguard.hw.amdgpu import od_disabled_reason
        from gpuguard.hw.amdgpu_od import parse_od

        dev = target.device
        transient = False
        rs = None
        try:
            rs = self.root.read_text(f"{dev}/power/runtime_status")
        except SysfsError:
            pass
        od = od_missing = od_error = None
        if not self.root.exists(f"{dev}/{OD_FILE}"):
            od_missing = od_disabled_reason(self.root)
        else:
            try:
                od = parse_od(self.root.read_bytes(f"{dev}/{OD_FILE}"), f"{dev}/{OD_FILE}")
            except SysfsError as e:
                od_error = str(e)
                transient |= e.errno in TRANSIENT
            except ValueError as e:
                od_error = str(e)
        cap = cap_error = None
        hw = self.hwmon(target)
        if hw is None:
            cap_error = f"{dev}/hwmon: no amdgpu hwmon folder"
        else:
            vals: dict[str, int | None] = {}
            for key in ("power1_cap", "power1_cap_min", "power1_cap_max", "power1_cap_default"):
                try:
                    vals[key] = self.root.read_int(f"{hw}/{key}") if self.root.exists(f"{hw}/{key}") else None
                except SysfsError as e:
                    vals[key] = None
                    cap_error = str(e)
                    transient |= e.errno in TRANSIENT
                except ValueError as e:  # a failed limit query prints an empty line (protocol §4)
                    vals[key] = None
                    cap_error = str(e)
            if any(v is not None for v in vals.values()):
                cap = CapLimits(vals["power1_cap_min"], vals["power1_cap_max"], vals["power1_cap_default"], vals["power1_cap"])
        level = None
        try:
            if self.root.exists(f"{dev}/{LEVEL_FILE}"):
                level = self.root.read_text(f"{dev}/{LEVEL_FILE}")
        except SysfsError as e:
            transient |= e.errno in TRANSIENT
        return CardReading(od, od_missing, od_error, cap, cap_error, level, rs, transient)

    # -- waking -------------------------------------------------------------------------
    def _wake(self, target: CardTarget, who: str, why: str) -> str | None:
        """Set power/control=on; returns the previous value to restore (None: nothing changed)."""
        path = f"{target.device}/power/control"
        try:
            old = self.root.read_text(path)
        except SysfsError:
            return None
        if old == "on":
            return None
        if self._write_file(target, path, "on", who, f"keep the card awake while applying ({why})") is not None:
            return None
        deadline = time.monotonic() + self.wake_timeout
        while time.monotonic() < deadline:
            try:
                if self.root.read_text(f"{target.device}/power/runtime_status") == "active":
                    break
            except SysfsError:
                break
            self.sleep(0.02)
        return old

    def _restore_power(self, target: CardTarget, old: str | None, who: str) -> None:
        if old is not None:
            self._write_file(target, f"{target.device}/power/control", old, who, "restore runtime power management")

    # -- writing ------------------------------------------------------------------------
    def _write_file(self, target: CardTarget, path: str, value: str, who: str, why: str) -> SysfsError | None:
        mark = getattr(self.kernel_reason, "mark", None)
        since = mark() if mark is not None else time.monotonic()
        rec = {"action": "write", "who": who, "why": why, "gpu": target.name, "bdf": target.bdf, "file": path, "value": value}
        if self.is_lost(target.bdf) or not self.may_write(target.bdf):
            e = SysfsError(path, errno_mod.ECANCELED, "write")
            e.text = (f"not written {value!r} to {path}: {target.name} ({target.bdf}) may not be written now "  # type: ignore[attr-defined]
                      "(lost, not answering, not identified, the daemon is stopping, or its apply was abandoned)")
            log.warning("gpu=%s %s", target.name, e.text)  # type: ignore[attr-defined]  # pragma: no mutate
            return e
        try:
            self.root.write_text(path, value + "\n")
        except SysfsError as e:
            reason = self.kernel_reason(target.bdf, since)
            text = f"write {value!r} to {path}: {_errno_text(e.errno)}"
            if reason:
                text += f"; kernel log: {reason}"
            elif e.errno == errno_mod.EINVAL:
                err = getattr(self.kernel_reason, "error", None)
                text += f"; kernel log: {err or 'no reason logged'}"
            e.text = text  # type: ignore[attr-defined]
            self.audit({**rec, "result": "error", "error": text})
            log.warning("gpu=%s %s", target.name, text)  # pragma: no mutate
            return e
        self.audit({**rec, "result": "ok"})
        return None

    def _paths(self, target: CardTarget) -> dict[str, str | None]:
        hw = self.hwmon(target)
        return {
            OD_FILE: f"{target.device}/{OD_FILE}",
            LEVEL_FILE: f"{target.device}/{LEVEL_FILE}",
            CAP_FILE: f"{hw}/{CAP_FILE}" if hw else None,
        }

    # -- the sequence ---------------------------------------------------------------------
    def apply(self, target: CardTarget, profile_name: str, profile: Profile, who: str, why: str,
              dry_run: bool = False) -> CardResult:
        return self._run(target, profile_name, lambda rd: plan_apply(
            target.name, profile_name, profile, rd.od, rd.cap, rd.od_missing), who, why, dry_run)

    def reset(self, target: CardTarget, who: str, why: str, dry_run: bool = False) -> CardResult:
        """`r` (+ `c` where needed) and the default power cap; verifies offsets 0 and the default cap."""
        return self._run(target, "stock", lambda rd: plan_reset(target.name, rd.od, rd.cap), who, why, dry_run)

    def _run(self, target: CardTarget, profile_name: str, make_plan: Callable[[CardReading], Plan],
             who: str, why: str, dry_run: bool) -> CardResult:
        base = dict(gpu=target.name, bdf=target.bdf, profile=profile_name)
        if self.is_lost(target.bdf) or not self.root.exists(target.device) or not self.may_write(target.bdf):
            # DESIGN.md: a GPU marked lost is never written to until it reappears.
            return CardResult(**base, result="lost", verified=False,
                              message=f"{target.name} ({target.bdf}) may not be written now (lost, not answering, "
                                      "not identified, or the daemon is stopping); nothing written")
        reading = self.read(target)
        woke: str | None = None
        try:
            if reading.transient and not dry_run:
                woke = self._wake(target, who, why)
                reading = self.read(target)
            before = reading.values()
            if reading.od_error and reading.od_missing is None:
                return CardResult(**base, result="error", verified=False, before=before,
                                  message=f"cannot read the OD table: {reading.od_error}", errors=(reading.od_error,))
            try:
                plan = make_plan(reading)
            except PlanError as e:
                return CardResult(**base, result=e.kind, verified=False, before=before,
                                  message="; ".join(e.problems), errors=tuple(e.problems))
            planned = tuple(str(w) for w in plan.writes)
            if dry_run:
                return CardResult(**base, result="dry-run", verified=False, before=before, planned=planned,
                                  expected=plan.expected, message="dry run: nothing written")
            if woke is None:
                woke = self._wake(target, who, why)
            return self._execute(target, plan, before, who, why)
        finally:
            self._restore_power(target, woke, who)

    def _execute(self, target: CardTarget, plan: Plan, before: Mapping[str, Any], who: str, why: str) -> CardResult:
        base = dict(gpu=target.name, bdf=target.bdf, profile=plan.profile, before=before,
                    planned=tuple(str(w) for w in plan.writes), expected=plan.expected)
        written: list[str] = []
        errors: list[str] = []
        readback: dict[str, Any] = {}
        attempts = 0
        for attempt in range(self.retries + 1):
            attempts = attempt + 1
            if attempt:
                self.sleep(self.backoff * (2 ** (attempt - 1)))
            if self.is_lost(target.bdf):
                return CardResult(**base, result="lost", verified=False, written=tuple(written), attempts=attempts,
                                  errors=tuple(errors), message="GPU lost during apply; writing stopped")
            paths = self._paths(target)
            failed: SysfsError | None = None
            for w in plan.writes:
                path = paths.get(w.file)
                if path is None:
                    failed = SysfsError(f"{target.device}/hwmon/*/{w.file}", errno_mod.ENOENT, "write")
                    failed.text = f"{w}: no amdgpu hwmon folder"  # type: ignore[attr-defined]
                    break
                failed = self._write_file(target, path, w.value, who, why)
                if failed is not None:
                    break
                written.append(str(w))
            if failed is not None:
                errors.append(getattr(failed, "text", str(failed)))
                if failed.errno == errno_mod.ECANCELED:
                    return CardResult(**base, result="lost", verified=False, written=tuple(written), attempts=attempts,
                                      errors=tuple(errors), message=errors[-1])
                if failed.errno in GONE:
                    return CardResult(**base, result="lost" if not self.root.exists(target.device) else "error",
                                      verified=False, written=tuple(written), attempts=attempts, errors=tuple(errors),
                                      message=errors[-1])
                if failed.errno not in TRANSIENT:
                    # EINVAL (refused: reason from the kernel log), EIO/EREMOTEIO/ETIME (GPU in
                    # trouble): retrying the same bytes will not help; stop touching the card.
                    reading = self.read(target)
                    return CardResult(**base, result="error", verified=False, written=tuple(written),
                                      readback=reading.values(), attempts=attempts, errors=tuple(errors),
                                      message=errors[-1])
                continue  # asleep/resetting: back off and try again
            reading = self.read(target)
            readback = reading.values()
            bad = mismatches(plan.expected, readback)
            if not bad and not plan.unreadable:
                self.audit({"action": "verified", "who": who, "why": why, "gpu": target.name, "bdf": target.bdf,
                            "profile": plan.profile, "readback": readback, "attempts": attempts})
                return CardResult(**base, result="ok", verified=True, written=tuple(written), readback=readback,
                                  attempts=attempts, errors=tuple(errors),
                                  message=f"read back equal after {attempts} attempt(s)")
            if plan.unreadable and not bad:
                msg = (f"{', '.join(plan.unreadable)} cannot be read back on this kernel (SMU14 before d9d4cb224e41 "
                       "prints the firmware limits instead of the setting): unverified")
                self.audit({"action": "unverified", "who": who, "why": why, "gpu": target.name, "bdf": target.bdf,
                            "profile": plan.profile, "readback": readback, "reason": msg})
                return CardResult(**base, result="mismatch", verified=False, written=tuple(written),
                                  readback=readback, attempts=attempts, errors=tuple(errors), message=msg)
            errors.append("read back differs: " + ", ".join(
                f"{k} wrote {exp} read {got if got is not None else '?'}" for k, (exp, got) in bad.items())
                + (f" ({reading.od_error})" if reading.od_error else ""))
            log.warning("gpu=%s attempt %d: %s", target.name, attempts, errors[-1])  # pragma: no mutate
        msg = f"still wrong after {attempts} attempt(s): {errors[-1] if errors else 'unknown'}"
        self.audit({"action": "unverified", "who": who, "why": why, "gpu": target.name, "bdf": target.bdf,
                    "profile": plan.profile, "readback": readback, "reason": msg})
        return CardResult(**base, result="mismatch", verified=False, written=tuple(written), readback=readback,
                          attempts=attempts, errors=tuple(errors), message=msg)
