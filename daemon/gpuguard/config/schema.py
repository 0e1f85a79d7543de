"""The config file's schema (pydantic). Every key is documented in config/gpuguard.yaml.
Unknown keys are errors: a typo must not silently fall back to a default."""
from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpuguard.engines.config import EngineConfig
from gpuguard.hw.pci_address import is_canonical, parse_bdf as normalise_bdf, parse_pci_id
from gpuguard.hw.pcie_expect import ExpectedLink
from gpuguard.kernel.config import KernelConfig
from gpuguard.profiles.schema import ApplyConfig, Profile, assignment_problems

from gpuguard.config.service import ApiConfig, WebhookConfig  # service layer sections
from gpuguard.config.power import PowerConfig  # fast power sampling + PSU budget



class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PollConfig(Strict):
    # a GPU that does not answer for this long is lost (engines killed, never written)
    lost_after_seconds: float = Field(10.0, gt=0, le=3600)
    interval_seconds: float = Field(1.0, ge=0.15, le=15.0, description="GPU telemetry interval")
    timeout_seconds: float = Field(2.0, gt=0, le=60, description="one GPU's read must finish in this time")
    discover_seconds: float = Field(5.0, ge=0.5, le=3600, description="how often to look for new/vanished GPUs")
    pcie_interval_seconds: float = Field(60.0, ge=1, le=3600, description="PCIe path refresh interval")


class ListenConfig(Strict):
    address: str = Field("127.0.0.1", description="loopback by default; 0.0.0.0 opens it to the network")
    port: int = Field(9436, ge=0, le=65535)


class GpuMatch(Strict):
    """How a configured name finds its GPU: by PCI address, or by PCI id plus the order
    among cards with that id (sorted by address). Never by cardN (INCIDENTS §8)."""

    bdf: str | None = None
    pci_id: str | None = None
    index: int = Field(0, ge=0)
    # How many cards of this id the host has; default: the highest configured index + 1.
    # Names by index are assigned only while exactly this many are present (identity.py).
    count: int | None = Field(None, ge=1, le=64)

    @field_validator("bdf")
    @classmethod
    def _bdf(cls, v: str | None) -> str | None:
        return None if v is None else normalise_bdf(v)

    @field_validator("pci_id")
    @classmethod
    def _pci_id(cls, v: str | None) -> str | None:
        return None if v is None else parse_pci_id(v)

    @model_validator(mode="after")
    def _one_way(self) -> "GpuMatch":
        if (self.bdf is None) == (self.pci_id is None):
            raise ValueError("give exactly one of bdf or pci_id")
        if self.count is not None and (self.pci_id is None or self.index >= self.count):
            raise ValueError("count goes with pci_id and must be greater than index")
        return self


class GpuEntry(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    match: GpuMatch
    profile: str | None = None
    # INCIDENTS §4: what the slot link must train to; a mismatch is an alert.
    expect_link: ExpectedLink | None = None

    @field_validator("name")
    @classmethod
    def _not_an_address(cls, v: str) -> str:
        # an unnamed GPU is called by its PCI address (state/identity.default_name): a
        # configured name that is one would be read as another card's
        if is_canonical(v):
            raise ValueError(f"{v!r} is a PCI address, the name of a GPU no entry names; give a name "
                             "(xtx-0) and put the address in match: {bdf: ...}")
        return v


class LoggingConfig(Strict):
    level: Literal["debug", "info", "warning", "error"] = "info"


class RecorderConfig(Strict):
    enabled: bool = True
    # INCIDENTS §2: samples written to /tmp were lost in the reboot the trip caused.
    # Not given: `state_dir`/flight.sqlite (Config._recorder_in_state_dir).
    path: str = "/var/lib/gpuguard/flight.sqlite"
    keep_seconds: float = Field(86400.0, ge=60)
    # bounded by size too (pages in use), pruned oldest first; ~16-21 MB/GPU/day at 1 s with the
    # power sampler's rows (bench/recorder_size.py)
    max_bytes: int = Field(512 * 1024 * 1024, ge=1024 * 1024)


class Config(Strict):
    sysfs_root: str = Field("/", description="root of the hardware tree ('/' on a real host)")
    state_dir: str = "/var/lib/gpuguard"
    poll: PollConfig = PollConfig()
    listen: ListenConfig = ListenConfig()
    gpus: list[GpuEntry] = []
    logging: LoggingConfig = LoggingConfig()
    recorder: RecorderConfig = RecorderConfig()
    kernel: KernelConfig = KernelConfig()
    engines: list[EngineConfig] = []
    api: ApiConfig = ApiConfig()  # control API auth, body limit, UNIX socket
    webhooks: list[WebhookConfig] = []  # alert-grade events POSTed here
    profiles: dict[str, Profile] = {}
    apply: ApplyConfig = ApplyConfig()
    power: PowerConfig = PowerConfig()  # fast power sampling, PSU budget (INCIDENTS §2)

    @model_validator(mode="before")
    @classmethod
    def _recorder_in_state_dir(cls, data: Any) -> Any:
        """`recorder.path` not given: the flight recorder lives in `state_dir` (by default
        /var/lib/gpuguard/flight.sqlite, as before). Two daemons with their own state
        folders wrote into one recorder file (every benchmark and test daemon did)."""
        if isinstance(data, dict) and isinstance(data.get("state_dir", "/var/lib/gpuguard"), str):
            rec = data.get("recorder")
            if rec is None or (isinstance(rec, dict) and "path" not in rec):
                state_dir = data.get("state_dir", "/var/lib/gpuguard")
                data = {**data, "recorder": {**(rec or {}), "path": os.path.join(state_dir, "flight.sqlite")}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _psu_clear_in_seconds(cls, data: Any) -> Any:
        """`power.clear_after_intervals: N`, the older spelling of the PSU alert's hysteresis,
        is N poll intervals: read as N · poll.interval_seconds seconds (config/power.py)."""
        if not isinstance(data, dict) or not isinstance(data.get("power"), dict):
            return data
        power = data["power"]
        if "clear_after_intervals" not in power:
            return data
        if "clear_after_seconds" in power:
            raise ValueError("power: give clear_after_seconds or the older clear_after_intervals, not both")
        n = power["clear_after_intervals"]
        poll = data.get("poll")
        interval = poll.get("interval_seconds", 1.0) if isinstance(poll, dict) else 1.0
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or not isinstance(interval, (int, float)):
            raise ValueError(f"power.clear_after_intervals must be a whole number of poll intervals >= 1, got {n!r}; "
                             "better, give power.clear_after_seconds")
        rest = {k: v for k, v in power.items() if k != "clear_after_intervals"}
        return {**data, "power": {**rest, "clear_after_seconds": n * float(interval)}}

    @model_validator(mode="after")
    def _cross_references(self) -> "Config":
        """Names that must point at something, checked together: each problem is keyed by
        the value that is wrong (`gpus[2].profile`), so the loader names it and its line."""
        problems = assignment_problems(self)
        first: dict[str, int] = {}
        for i, g in enumerate(self.gpus):
            if g.name in first:
                problems.append((("gpus", i, "name"), f"GPU name {g.name!r} is used twice in gpus (first at gpus[{first[g.name]}])"))
            first.setdefault(g.name, i)
        seen_engines: set[str] = set()
        for i, e in enumerate(self.engines):
            if e.name in seen_engines:
                problems.append((("engines", i, "name"), f"engine name {e.name!r} is used twice in engines"))
            seen_engines.add(e.name)
            for j, gpu in enumerate(e.gpus):
                if gpu in first:
                    continue
                if gpu.startswith("card") and is_canonical(gpu[4:]):
                    # unnamed GPUs were `card` + address once; that name now matches no GPU
                    problems.append((("engines", i, "gpus", j), f"engine {e.name}: {gpu!r}: a GPU without a configured "
                                                                 f"name is called by its PCI address: write {gpu[4:]!r}"))
                elif first and not is_canonical(gpu):
                    problems.append((("engines", i, "gpus", j), f"engine {e.name}: {gpu!r} is not a name in gpus: "
                                                                 f"({', '.join(sorted(first))})"))
        if problems:
            raise KeyedProblems(problems)
        return self


class KeyedProblems(ValueError):
    """Problems found across sections, each with the key path (relative to the model that
    raised it) of the value at fault; config/loader.py turns each into its own line."""

    def __init__(self, problems: list[tuple[tuple, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in problems))
