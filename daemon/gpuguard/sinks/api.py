"""The HTTP surface of the daemon (FastAPI on uvicorn, same process and event loop):
`/metrics`, `/healthz` and the JSON control API under `/v1/`, put together from the read
routes (sinks/read_api.py: the hub's latest state or a provider's in-memory view, never
hardware) and the action routes (control/routes.py), behind the body limit
(sinks/body_limit.py).

Access (control/auth.py, control/access.py): every POST needs `Authorization: Bearer
<token>` (401 otherwise); GETs need one too when the daemon listens beyond loopback
without `api.open_reads`; `/healthz` is always open. Every authenticated POST lands in the audit log with the
token's name, whatever its outcome. Order of checks on a POST: 413 (body too large,
before anything is parsed) → 401 → 404 (path name unknown) → 422 (body) → 501 (no
provider) → the action (409 refused, 404 unknown to the provider).

Path parameters are names, never paths: each must match control/access.NAME_RE and be one
of the known GPUs / engines / caches before anything else sees it.

JSON shapes (stable; the CLI's status/events/engines read them):
  GET /healthz            {"ok": bool, "last_poll": float|null,
                           "state_dir": {"usable": bool, "reason": str|null}}  (ok: telemetry flows;
                           state_dir unusable: applies and other audited actions answer 503)
  GET /v1/status          {"version", "time", "summary": str, "last_poll": {source: time},
                           "gpus": [gpu], "pending_confirm": {gpu: pending}}
  GET /v1/gpus            [gpu]          gpu = GpuSnapshot.to_dict()
  GET /v1/gpus/{gpu}      gpu            by configured name or PCI address
  GET /v1/events?since=T&limit=N   [event]   event = Event.to_dict(), oldest first
  GET /v1/engines         [{"name": str, ...provider fields}]
  GET /v1/incidents       [{"name": str, "engine": str, "files": [...], ...}] engine incident bundles
  GET /v1/profiles        [{"name": str, ...provider fields}]
  GET /v1/pcie            PcieReport.to_dict() (`gpuguard pcie --json`) + {"findings": [doctor finding]}
  GET /v1/power           the last interval's per-GPU peak/p99/mean and the PSU verdict + advice
  (a read provider with nothing yet answers 503)
  GET /v1/config          the effective config (webhook URLs redacted)
  POST bodies             {"reason": str?}; apply: {"profile": str, "confirm_within": s?, "reason": str?}
  503                     the audit record could not be written first: nothing was changed
  POST answers            {"ok": true, "action", "target", "who", "result", "pending_confirm": pending|null}
  pending                 {"gpu", "profile", "who", "confirm_within", "revert_at"}
  errors                  {"detail": str}  (422: {"detail": [{"loc": [...], "msg", "type"}]})
"""
from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI

from gpuguard import __version__
from gpuguard.control.actions import Actions
from gpuguard.control.auth import AccessPolicy, TokenStore
from gpuguard.control.confirm import ConfirmWindows
from gpuguard.control.routes import router as action_routes
from gpuguard.sinks.body_limit import DEFAULT_MAX_BODY, BodyLimit
from gpuguard.sinks.metrics import MetricsSink
from gpuguard.sinks.read_api import router as read_routes
from gpuguard.state.audit import AuditLog
from gpuguard.state.hub import Hub


def build_app(
    hub: Hub,
    metrics: MetricsSink,
    *,
    tokens: TokenStore | None = None,
    policy: AccessPolicy | None = None,
    audit: AuditLog | None = None,
    actions: Actions | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY,
    config_view: Callable[[], dict[str, Any]] | None = None,
) -> FastAPI:
    """The app. Reload swaps `app.state.tokens`, `.policy`, `.max_body_bytes`; other parts
    register providers on `app.state.actions`. The routes read everything else they need
    from `app.state` too."""
    # redirect_slashes off: a 307 to a rewritten path is not an answer a name check should give
    app = FastAPI(title="gpuguard", version=__version__, docs_url=None, redoc_url=None, redirect_slashes=False)
    app.state.hub = hub
    app.state.metrics = metrics
    app.state.tokens = tokens or TokenStore()
    app.state.policy = policy or AccessPolicy()
    app.state.audit = audit
    app.state.actions = actions or Actions()
    app.state.max_body_bytes = max_body_bytes
    app.state.config_view = config_view
    app.state.confirm = ConfirmWindows(hub, audit, lambda: app.state.actions.restore_state)
    app.add_middleware(BodyLimit, limit=lambda: app.state.max_body_bytes)
    app.include_router(read_routes)
    app.include_router(action_routes)
    return app
