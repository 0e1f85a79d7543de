"""Config section `power:` — the fast power sampler and the host PSU budget
(INCIDENTS §2: two cards tripped a 1300 W supply on their transients while the averages
looked safe). Hangs off the root `Config` as `power: PowerConfig`."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PowerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sampler: bool = Field(True, description="sample each GPU's power sensor fast, between polls")
    sample_hz: float = Field(20.0, ge=1.0, le=100.0, description="samples per second per GPU")
    # Each GPU's sampling thread halves its rate when it uses more than this share of one
    # core (measured on the thread itself): telemetry must not become the load.
    cpu_budget_ratio: float = Field(0.02, gt=0, le=1.0)
    # A GPU under this share of its power cap is at rest; with every GPU at rest for
    # rest_after_seconds the sampler reads once a second (on the poll's second) instead of
    # sample_hz, and the first reading over a line brings the full rate back. An idle host
    # then pays one wakeup a second for the sampler, not 20 (issue 15). 0 = never rest.
    rest_below_ratio: float = Field(0.2, ge=0, lt=1.0,
                                    description="share of each GPU's cap under which it is at rest (0 = never rest)")
    rest_after_seconds: float = Field(10.0, ge=0.1, le=3600,
                                      description="every GPU at rest this long: the sampler slows to once a second")
    # Raw samples kept in memory per GPU; the ones before a headroom alert go to the
    # flight recorder with it.
    burst_seconds: float = Field(5.0, ge=0.5, le=60.0)
    psu_watts: float | None = Field(None, gt=0, le=100000, description="the supply's rating; None = no budget check")
    other_watts: float = Field(0.0, ge=0, le=100000, description="CPUs, drives, fans: what the rest of the host draws")
    # Alert when GPU peaks + other_watts come within this share of psu_watts. Generous by
    # default: 20–50 Hz samples of an averaged sensor under-read the millisecond transients
    # a supply's protection reacts to.
    margin_ratio: float = Field(0.25, ge=0, lt=1.0)
    # Hysteresis: the alert clears only after the peaks have stayed clear_margin_ratio ·
    # psu_watts under the line for this long. Peaks of a loaded host wander around the line
    # (INCIDENTS §2: 249–289 W per card); clearing on the first dips re-raised it again and
    # again, one page per dip, for what is one condition. In seconds, not poll intervals: 5
    # intervals were 2.5 s at a 0.5 s poll, and two R9700 at full load for 47 s paged three
    # times. The older `clear_after_intervals: N` is read as N poll intervals (Config).
    clear_margin_ratio: float = Field(0.05, ge=0, lt=1.0, description="share of psu_watts under the line that counts as clear")
    clear_after_seconds: float = Field(5.0, gt=0, le=3600,
                                       description="seconds in a row clear of the line before the alert clears")
