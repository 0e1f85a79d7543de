"""The HTTP surface of the daemon (one ASGI app on uvicorn, same process and event loop):
`/metrics`, `/healthz` and the JSON API under `/v1/`, behind the body limit
(sinks/body_limit.py), in three parts by cost:

  `/metrics`   answered first, before any routing: a scrape is the one request that
               comes every few seconds all day (issue 15: the framework's layers were a
               third of its CPU)
  reads        Starlette routes (sinks/read_api.py, sinks/page.py: the hub's latest state
               or a provider's in-memory view, never hardware)
  actions      the FastAPI control app (control/routes.py), built on the first request
               for one of its paths (control/paths.py): a daemon that is only read and
               scraped never imports FastAPI (11 MiB of issue 15's 48 MiB)

All three share one `state` (`app.state.hub`, `.tokens`, ...) and one error shape.

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

import logging
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gpuguard import __version__
from gpuguard.control.access import read_access
from gpuguard.control.actions import Actions
from gpuguard.control.auth import AccessPolicy, TokenStore
from gpuguard.control.confirm import ConfirmWindows
from gpuguard.control.paths import is_control_path
from gpuguard.sinks.body_limit import DEFAULT_MAX_BODY, BodyLimit
from gpuguard.sinks.metrics import CONTENT_TYPE, MetricsSink
from gpuguard.sinks.read_api import ROUTES as READ_ROUTES
from gpuguard.state.audit import AuditLog
from gpuguard.state.hub import Hub

log = logging.getLogger("gpuguard.api")
_METRICS_HEADERS = [(b"content-type", CONTENT_TYPE.encode())]


async def http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's answer to an HTTPException, for every part: `{"detail": ...}` as JSON
    with the exception's headers (none for a status that carries no body)."""
    assert isinstance(exc, HTTPException)
    if exc.status_code < 200 or exc.status_code in (204, 304):
        return Response(status_code=exc.status_code, headers=exc.headers)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


class Api:
    """The daemon's ASGI app. `state` is what the routes read (`request.app.state`);
    `reads` the Starlette app of the read routes; `control()` the FastAPI app of the
    action routes, built on first use."""

    def __init__(self, state: State, max_body: Callable[[], int]) -> None:
        self.state = state
        # /metrics is a route too (listed, 405 for a POST); GET and HEAD are answered before routing
        routes = [Route("/metrics", self._metrics_route, methods=["GET"]), *READ_ROUTES]
        self.reads = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
        self.reads.router.redirect_slashes = False  # a 307 to a rewritten path is not an answer a name check gives
        self.reads.state = state
        self._control: Any = None
        self._asgi = BodyLimit(self._route, limit=max_body)

    def add_reads(self, routes: list[Route]) -> None:
        self.reads.router.routes.extend(routes)

    def control(self) -> Any:
        if self._control is None:
            from fastapi import FastAPI

            from gpuguard.control.routes import router

            # redirect_slashes off: a 307 to a rewritten path is not an answer a name check should give
            app = FastAPI(title="gpuguard", version=__version__, docs_url=None, redoc_url=None,
                          redirect_slashes=False)
            app.state = self.state
            app.add_exception_handler(HTTPException, http_error)
            app.include_router(router)
            self._control = app
            log.info("control API loaded (first request for an action route)")
        return self._control

    @property
    def routes(self) -> list[Any]:
        """Every route of every part (loads the control app)."""
        return list(self.reads.routes) + list(self.control().routes)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            return await self._metrics(scope, send)
        await self._asgi(scope, receive, send)

    async def _route(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and is_control_path(scope["path"]):
            return await self.control()(scope, receive, send)
        await self.reads(scope, receive, send)

    async def _metrics(self, scope: dict, send: Callable) -> None:
        # on the loop: the render formats memory only (blocks served as rendered when
        # unchanged), and a worker thread would hold the GIL for it anyway
        scope["app"] = self
        try:
            read_access(Request(scope))
            body = self.state.metrics.render()
        except HTTPException as e:
            return await self._send(send, await http_error(Request(scope), e))
        except Exception:  # noqa: BLE001 - one bad scrape is a 500 and a log line, never a dead server
            log.exception("GET /metrics failed")
            return await self._send(send, JSONResponse({"detail": "rendering /metrics failed; see the daemon's log"},
                                                       status_code=500))
        await send({"type": "http.response.start", "status": 200,
                    "headers": _METRICS_HEADERS + [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body if scope["method"] == "GET" else b""})

    async def _metrics_route(self, request: Request) -> Response:
        read_access(request)
        return Response(self.state.metrics.render(), media_type=CONTENT_TYPE)

    @staticmethod
    async def _send(send: Callable, response: Response) -> None:
        await response({"type": "http"}, None, send)  # type: ignore[arg-type]


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
) -> Api:
    """The app. Reload swaps `app.state.tokens`, `.policy`, `.max_body_bytes`; other parts
    register providers on `app.state.actions`. The routes read everything else they need
    from `app.state` too."""
    state = State()
    state.hub = hub
    state.metrics = metrics
    state.tokens = tokens or TokenStore()
    state.policy = policy or AccessPolicy()
    state.audit = audit
    state.actions = actions or Actions()
    state.max_body_bytes = max_body_bytes
    state.config_view = config_view
    state.confirm = ConfirmWindows(hub, audit, lambda: state.actions.restore_state)
    return Api(state, lambda: state.max_body_bytes)
