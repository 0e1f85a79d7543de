"""The `engines:` config list: one `EngineConfig` per watched inference engine (pydantic v2,
unknown keys refused). Owns defaults and cross-field checks; the integrator hangs
`EnginesConfig.engines` under the root config."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

KINDS = ("vllm", "sglang", "llamacpp", "generic")
Kind = Literal["vllm", "sglang", "llamacpp", "generic"]
Action = Literal["alert", "kill", "restart"]

# The process that owns the GPU, per kind (ENGINES.md "/proc evidence"): the API server of
# vLLM and SGLang stays idle and healthy while the engine core spins, so CPU is read here.
DEFAULT_GPU_PROCESS = {
    "vllm": r"EngineCore|VLLM::Engine",
    "sglang": r"sglang::scheduler|scheduler",
    "llamacpp": None,  # llama-server is one process: the main PID is the GPU owner
    "generic": None,
}


# Command lines of processes that are no engine (init, a shell, a script, a tool): a
# `cmdline` regex that matches the empty string or every one of these matches any process,
# and a kill aimed by it could take anything (it resolved to PID 1).
UNRELATED_COMMAND_LINES = ("/sbin/init", "sh", "python3 x.py", "ls -l")


def matches_any_process(pattern: str) -> str | None:
    """What shows that `pattern` matches any process ("an empty command line" or the
    unrelated command line it matched first); None when it names something narrower."""
    rx = re.compile(pattern)
    if rx.search(""):
        return "an empty command line"
    if all(rx.search(line) for line in UNRELATED_COMMAND_LINES):
        return repr(UNRELATED_COMMAND_LINES[0])
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProcessMatch(_Strict):
    """How to find the engine's main process; resolved to a PID every cycle, never cached."""

    systemd_unit: str | None = None
    cgroup: Path | None = Field(
        None, description="a cgroup folder (e.g. /sys/fs/cgroup/engines.slice/x.scope): its cgroup.procs "
        "are the engine; the kill goes through it")
    pid_file: Path | None = None
    cmdline: str | None = Field(None, description="regex searched in the space-joined command line")
    gpu_process: str | None = Field(
        None, description="regex (name or command line) of the descendant that owns the GPU; "
        "default per kind, else the main process")
    user: str | int | None = Field(
        None, description="the Unix user (name or uid) the engine runs as: its pid file may be owned by "
        "it (else only root), and the process found must run as it")

    @model_validator(mode="after")
    def _exactly_one(self) -> "ProcessMatch":
        given = [k for k in ("systemd_unit", "cgroup", "pid_file", "cmdline") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("process: give exactly one of systemd_unit, cgroup, pid_file, cmdline "
                             f"(got {', '.join(given) or 'none'})")
        for key in ("cmdline", "gpu_process"):
            pattern = getattr(self, key)
            if pattern:
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ValueError(f"process.{key}: invalid regex {pattern!r}: {exc}") from None
        if self.cmdline and (what := matches_any_process(self.cmdline)):
            raise ValueError(f"process.cmdline: {self.cmdline!r} matches any process (it matches {what}); "
                             "name the engine's own command line, e.g. 'vllm serve .*--port 8000'")
        return self


class GenericMetrics(_Strict):
    """Metric selectors for `kind: generic` (and overrides for the others): PromQL-style
    `name{label="value"}`, each list summed. `heartbeat` must move every engine step."""

    running: list[str] = []
    waiting: list[str] = []
    heartbeat: list[str] = []
    tokens: list[str] = []
    decode: list[str] = []
    prefill: list[str] = []


class CacheFolder(_Strict):
    name: str
    path: Path
    # INCIDENTS §7: the Triton key folders written at the same moment as a broken torch
    # compile cache are as broken; they are quarantined with it, one renamed set.
    related: list[Path] = Field(
        [], description="folders quarantined together with this cache (same .BROKEN-<stamp>-<reason> "
        "suffix, never deleted), e.g. the Triton cache written by the same compile")

    @model_validator(mode="after")
    def _related_apart(self) -> "CacheFolder":
        for r in self.related:
            if r == self.path or self.path in r.parents or r in self.path.parents:
                raise ValueError(f"caches.{self.name}.related: {r} is {self.path} or nested with it; "
                                 "name folders beside the cache (one inside it is moved with it already)")
        if len(set(self.related)) != len(self.related):
            raise ValueError(f"caches.{self.name}.related: a folder is named twice")
        return self


class RestartLoop(_Strict):
    """INCIDENTS §7: N starts within `window` seconds is a restart loop."""

    count: int = Field(3, ge=2)
    window: float = Field(900.0, gt=0)
    quarantine: bool = False


class EngineConfig(_Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$")
    kind: Kind
    url: str = Field(..., description="base URL, e.g. http://127.0.0.1:8000")
    process: ProcessMatch
    gpus: list[str] = []
    health_path: str | None = None
    metrics_path: str = "/metrics"
    metrics: GenericMetrics | None = None

    poll_interval: float = Field(2.0, gt=0)
    http_timeout: float = Field(2.0, gt=0)
    health_timeout: float | None = Field(None, gt=0)

    stall_after: float = Field(60.0, gt=0)
    stall_step_multiple: float | None = Field(None, gt=0)
    stall_floor: float = Field(5.0, gt=0)
    # INCIDENTS §9: one engine step may carry a whole prompt batch (llama-server
    # runs up to n_batch prompt tokens in one llama_decode, nothing moves meanwhile). The
    # stall bound stretches to the time that batch takes at the measured prefill rate.
    prefill_batch_tokens: int | None = Field(
        None, gt=0, description="largest prompt batch of one step; default from the engine's command "
        "line (-b/--batch-size, --max-num-batched-tokens, --chunked-prefill-size), else 2048 (llama-server) "
        "or 8192")
    prefill_margin: float = Field(2.0, ge=1.0, description="slack on the batch's expected time")
    prefill_ceiling: float = Field(300.0, gt=0, description="the stretched bound never exceeds this")
    cpu_busy_ratio: float = Field(0.9, gt=0, description="fraction of one core that counts as pinned")
    unhealthy_after: float = Field(30.0, gt=0)
    ready_timeout: float = Field(900.0, gt=0)

    # The graded response: alert at stall_after (the stall is declared, evidence
    # collection starts), take the incident bundle at dump_after, act at kill_after (all
    # seconds without progress; unset = at stall_after, today's behaviour). A freeze that
    # clears before kill_after is recorded as a pause, not killed.
    dump_after: float | None = Field(None, gt=0)
    kill_after: float | None = Field(None, gt=0)
    action: Action = "alert"
    act_on_unhealthy: bool = True
    grace: float = Field(10.0, ge=0)
    restart_command: list[str] | None = None

    caches: list[CacheFolder] = []
    cache_scan_interval: float = Field(60.0, gt=0)
    restart_loop: RestartLoop = RestartLoop()

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^https?://[^/]+", v):
            raise ValueError(f"url {v!r} must look like http://HOST:PORT")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _checks(self) -> "EngineConfig":
        if self.kind == "generic" and not (self.metrics and self.metrics.heartbeat):
            raise ValueError("kind generic needs metrics.heartbeat (a counter that moves every step)")
        if self.action == "restart" and not (self.process.systemd_unit or self.restart_command):
            # A kill announced as a restart leaves the engine down: refuse it.
            raise ValueError("action restart needs a way to restart: process.systemd_unit or restart_command "
                             "(e.g. [\"systemctl\", \"start\", \"my-engine\"]); or use action kill")
        if self.kill_after is not None and self.kill_after < self.stall_after:
            raise ValueError(f"kill_after ({self.kill_after:g}) must be >= stall_after ({self.stall_after:g}), "
                             "the point the stall is declared")
        if self.dump_after is not None and not self.stall_after <= self.dump_after <= self.effective_kill_after:
            raise ValueError(f"dump_after ({self.dump_after:g}) must lie between stall_after and kill_after")
        names = [c.name for c in self.caches]
        if len(set(names)) != len(names):
            raise ValueError("caches: names must be unique")
        return self

    @property
    def effective_kill_after(self) -> float:
        return self.kill_after if self.kill_after is not None else self.stall_after

    @property
    def effective_dump_after(self) -> float:
        return self.dump_after if self.dump_after is not None else self.effective_kill_after

    @property
    def effective_health_timeout(self) -> float:
        return self.health_timeout or self.http_timeout

    @property
    def gpu_process_pattern(self) -> str | None:
        return self.process.gpu_process or DEFAULT_GPU_PROCESS[self.kind]


class EnginesConfig(_Strict):
    engines: list[EngineConfig] = []

    @model_validator(mode="after")
    def _unique(self) -> "EnginesConfig":
        names = [e.name for e in self.engines]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"engines: duplicate name(s) {sorted(dup)}")
        return self
