"""The `kernel:` section of gpuguard.yaml: where the kernel log is, which rules apply,
where the read position is kept, and what gpuguard does per event kind (policy).

Policy actions:
- `alert`: hand the event to the notifier (webhooks, audit);
- `mark_lost`: the GPU is lost: nothing writes to it until it reappears (DESIGN safety rule);
- `kill_engines`: the engine watchdog kills the engines on that GPU at once (INCIDENTS §1:
  `sq_intr` → `device lost from bus` → `GPU Recovery Failed: -19` within a minute);
- `recover`: after a successful reset the card is back at stock settings and every context
  on it is dead (`VRAM is lost`): re-verify/re-apply its profile, restart its engines.
Kinds not listed only count and are recorded. A user's `policy:` entries replace the
default for the kinds they name and keep the others.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Action = Literal["alert", "mark_lost", "kill_engines", "recover"]

DEFAULT_POLICY: dict[str, list[str]] = {
    "device_lost": ["alert", "mark_lost", "kill_engines"],
    "gpu_lost": ["alert", "mark_lost", "kill_engines"],  # udev remove of a GPU
    "gpu_reset_failed": ["alert", "mark_lost", "kill_engines"],  # -19 = ENODEV: gone
    "gpu_hang": ["alert", "kill_engines"],
    "sq_interrupt": ["alert", "kill_engines"],
    "gpu_reset_start": ["alert"],
    "gpu_reset_ok": ["alert", "recover"],
    "vm_fault": ["alert"],
    "pcie_aer_uncorrected": ["alert"],
    "pcie_link_down": ["alert"],
    "nvidia_xid": ["alert"],
    "nvidia_ecc_uncorrected": ["alert"],  # from NVML's event set (hw/nvml_events.py)
    "thermal_throttle": ["alert"],
    "oom_kill": ["alert"],
    "hung_task": ["alert"],
    "p2p_unsupported": [],
    "pcie_aer_corrected": [],
    "bar_size": [],
}


class KernelConfig(BaseModel):
    """`kernel:` section."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    kmsg_path: str = "/dev/kmsg"
    # Records written from user space (facility != 0) are ignored unless allowed (tests).
    allow_userspace: bool = False
    builtin_rules: bool = True
    rules_file: str | None = Field(default=None, description="extra YAML rules, tried before the built-in ones")
    # Where the last seen record's sequence number is kept, so a restart neither re-alerts
    # old lines nor misses new ones. Default: <state_dir>/kmsg-position.json.
    state_file: str | None = None
    batch: int = Field(default=256, ge=1, le=65536, description="records per loop turn")
    event_buffer: int = Field(default=1000, ge=10, le=1_000_000, description="events kept in memory")
    action_debounce_seconds: float = Field(default=30.0, ge=0, description="one hook call per GPU and action within this window")
    recover_settle_seconds: float = Field(default=2.0, ge=0, description="wait after the last reset-ok line before recovering")
    udev: bool = True
    udev_source: Literal["auto", "udev", "kernel"] = "auto"
    policy: dict[str, list[Action]] = Field(default_factory=lambda: {k: list(v) for k, v in DEFAULT_POLICY.items()})

    @field_validator("policy")
    @classmethod
    def _merge_defaults(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        import re

        for kind in v:
            if not re.fullmatch(r"[a-z][a-z0-9_]*", kind):
                raise ValueError(f"policy key {kind!r} is not an event kind (lower_snake_case)")
        merged = {k: list(a) for k, a in DEFAULT_POLICY.items()}
        merged.update({k: list(dict.fromkeys(a)) for k, a in v.items()})
        return merged
