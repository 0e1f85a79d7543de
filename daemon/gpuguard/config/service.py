"""Config sections of the service layer: the control API (`api:`) and webhook alerts
(`webhooks:`). They hang off the root `Config` as `api: ApiConfig` and
`webhooks: list[WebhookConfig]`; the listen address itself stays in `listen:`."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ApiConfig(_Strict):
    # A file readable by root only (mode 0600/0400), one `name: token` per line (YAML
    # mapping). None = no tokens: every mutating call is refused with 401.
    token_file: str | None = Field(None, description="bearer tokens, name: token, mode 0600")
    # Reads (GET /v1/*, /metrics) need a token when the listen address is not loopback,
    # unless this switch is set (INCIDENTS §10: an open endpoint on a LAN is unsafe).
    open_reads: bool = False
    # Request bodies above this are refused with 413 before they are parsed.
    max_body_bytes: int = Field(65536, ge=256, le=16 * 1024 * 1024)
    # Also serve the API on this UNIX socket (mode 0600), e.g. /run/gpuguard/api.sock.
    unix_socket: str | None = None

    @field_validator("token_file", "unix_socket")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"{v!r} must be an absolute path")
        return v


class WebhookConfig(_Strict):
    url: str = Field(pattern=r"^https?://[^\s]+$", description="alert-grade events are POSTed here as JSON")
    timeout_seconds: float = Field(5.0, gt=0, le=60)
    # Attempts after the first; waits 0.5 s, 1 s, 2 s, ... (capped at 30 s) between them.
    retries: int = Field(3, ge=0, le=10)
    # one webhook per condition (kind, GPU, engine) per window; repeats counted
    debounce_seconds: float = Field(60.0, ge=0, le=86400)
