"""Config models of the profile feature: what a profile may set, how applying behaves,
and the view of the root config the profile code reads (`ProfilesConfig.from_root`).

Hangs off the root config as `profiles: {name: Profile}`, `apply: ApplyConfig` and the
existing `gpus[].profile` (a profile name). Unknown keys are errors, as everywhere.
"""
from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Settings a profile can ask for; the card's own OD table decides which it has.
OD_SETTINGS = ("sclk_offset_mhz", "sclk_min_mhz", "sclk_max_mhz", "mclk_max_mhz", "vddgfx_offset_mv")
SETTINGS = ("power_cap_w",) + OD_SETTINGS

PerformanceLevel = Literal[
    "auto", "low", "high", "manual", "profile_standard", "profile_min_sclk", "profile_min_mclk", "profile_peak"
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Bounds(_Strict):
    """An envelope for one setting: what this profile may ever write, whatever the card allows."""

    min: int | None = None
    max: int | None = None

    @model_validator(mode="after")
    def _ordered(self) -> "Bounds":
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        return self


class Profile(_Strict):
    """Clock, voltage and power settings for one or more GPUs. Every field is optional:
    only what is given is written. Offsets are relative to the card's stock V/F curve."""

    power_cap_w: int | None = Field(None, ge=0, le=2000, description="hwmon power1_cap in whole watts")
    sclk_offset_mhz: int | None = Field(None, ge=-5000, le=5000, description="RDNA4-style SCLK offset")
    sclk_min_mhz: int | None = Field(None, ge=0, le=10000, description="RDNA1-3-style SCLK minimum")
    sclk_max_mhz: int | None = Field(None, ge=0, le=10000, description="RDNA1-3-style SCLK maximum")
    mclk_max_mhz: int | None = Field(None, ge=0, le=10000, description="memory clock maximum")
    vddgfx_offset_mv: int | None = Field(None, ge=-1000, le=1000, description="GFX voltage offset")
    performance_level: PerformanceLevel | None = None
    # INCIDENTS §2/§3: undervolting is the point; overvolting is never an accident.
    allow_overvolt: bool = False
    envelope: dict[Literal[SETTINGS], Bounds] = {}  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _min_below_max(self) -> "Profile":
        if self.sclk_min_mhz is not None and self.sclk_max_mhz is not None and self.sclk_min_mhz > self.sclk_max_mhz:
            raise ValueError(f"sclk_min_mhz {self.sclk_min_mhz} is above sclk_max_mhz {self.sclk_max_mhz}")
        return self

    def values(self) -> dict[str, int]:
        """The settings this profile writes (power cap and OD), by setting name."""
        return {k: getattr(self, k) for k in SETTINGS if getattr(self, k) is not None}


class ApplyConfig(_Strict):
    enabled: bool = Field(True, description="apply profiles at start, to late cards and after drift")
    # INCIDENTS §2: the boot service ran before the second card existed; wait for all of them.
    wait_for_gpus: int = Field(0, ge=0, le=64, description="apply only once this many GPUs are present")
    wait_timeout_seconds: float = Field(120.0, ge=0, le=3600)
    retries: int = Field(3, ge=0, le=20, description="re-writes after a read-back mismatch")
    backoff_seconds: float = Field(0.5, ge=0, le=60, description="first retry delay; doubles per retry")
    # one card's whole apply (reads, writes, read-back, retries) must end within
    # this; a card whose OD file blocks is abandoned with an alert, never waited on forever
    timeout_seconds: float = Field(30.0, gt=0, le=600, description="one card's apply must finish in this time")
    drift_check: bool = Field(True, description="compare every poll with the profile and re-apply on drift")
    effective_check: bool = Field(True, description="compare the clock under load with the profile")
    effective_busy_ratio: float = Field(0.8, ge=0, le=1, description="a card counts as loaded above this")
    effective_tolerance_ratio: float = Field(0.15, gt=0, le=1, description="allowed clock deviation")
    safe_mode_window_seconds: float = Field(300.0, ge=10, le=86400, description="a host crash this soon after apply counts")
    safe_mode_after_crashes: int = Field(2, ge=1, le=10)


class ProfilesConfig(_Strict):
    """What the profile code needs from the root config, collected in one place."""

    profiles: dict[str, Profile] = {}
    apply: ApplyConfig = ApplyConfig()
    assignments: dict[str, str] = {}  # GPU name -> profile name (gpus[].profile)
    state_dir: str = "/var/lib/gpuguard"

    @model_validator(mode="after")
    def _assigned_profiles_exist(self) -> "ProfilesConfig":
        for gpu, name in self.assignments.items():
            if name not in self.profiles:
                known = ", ".join(sorted(self.profiles)) or "none defined"
                raise ValueError(f"GPU {gpu!r} is assigned profile {name!r}, which is not in profiles ({known})")
        return self

    @classmethod
    def from_root(cls, config: Any) -> "ProfilesConfig":
        """Read `profiles`, `apply`, `gpus[].profile` and `state_dir` off the root config."""
        profiles: Mapping[str, Profile] = getattr(config, "profiles", None) or {}
        apply = getattr(config, "apply", None) or ApplyConfig()
        assignments = {g.name: g.profile for g in getattr(config, "gpus", []) if getattr(g, "profile", None)}
        return cls(
            profiles=dict(profiles),
            apply=apply,
            assignments=assignments,
            state_dir=getattr(config, "state_dir", "/var/lib/gpuguard"),
        )


def assignment_problems(config: Any) -> list[tuple[tuple, str]]:
    """`gpus[i].profile` names that no profile defines, as (key path, message) pairs for
    the root config's validator: the path is the key that holds the wrong name."""
    profiles = getattr(config, "profiles", None) or {}
    known = ", ".join(sorted(profiles)) or "none"
    out = []
    for i, g in enumerate(getattr(config, "gpus", [])):
        if g.profile and g.profile not in profiles:
            out.append((("gpus", i, "profile"), f"profile {g.profile!r} is not defined under profiles (defined: {known})"))
    return out
