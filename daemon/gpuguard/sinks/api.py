"""The HTTP surface of the daemon (FastAPI on uvicorn, same process and event loop):
`/metrics`, `/healthz` and the JSON control API under `/v1/`. Read endpoints serve the
hub's latest state (or a provider's in-memory view) and never touch hardware.

Access (control/auth.py): every POST needs `Authorization: Bearer <token>` (401 otherwise);
GETs need one too when the daemon listens beyond loopback without `api.open_reads`;
`/healthz` is always open. Every authenticated POST lands in the audit log with the
token's name, whatever its outcome. Order of checks on a POST: 413 (body too large,
before anything is parsed) → 401 → 404 (path name unknown) → 422 (body) → 501 (no
provider) → the action (409 refused, 404 unknown to the provider).

Path parameters are names, never paths: each must match NAME_RE and be one of the known
GPUs / engines / caches before anything else sees it.

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

import asyncio
import inspect
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuguard import __version__
from gpuguard.control.actions import ActionRefused, Actions
from gpuguard.state.audit import AuditLog, AuditUnavailable, jsonable
from gpuguard.control.auth import AccessPolicy, Caller, TokenStore, bearer_token
from gpuguard.control.confirm import ConfirmWindows
from gpuguard.sinks.metrics import CONTENT_TYPE, MetricsSink
from gpuguard.state.events import Event
from gpuguard.state.hub import Hub

log = logging.getLogger("gpuguard.api")

# GPU names follow config's GpuEntry pattern; PCI addresses (0000:05:00.0) fit too.
NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
DEFAULT_MAX_BODY = 65536


def status_document(hub: Hub) -> dict[str, Any]:
    snap = hub.snapshot
    gpus = [g.to_dict() for g in snap.gpus] if snap else []
    return {
        "version": __version__,
        "time": time.time(),
        "last_poll": dict(hub.last_poll),
        "gpus": gpus,
        "summary": summary_line(hub),
        # per GPU: identity, presence (present/not_answering/lost and by which route),
        # profile state; and the configured cards that are missing
        "gpu_states": [st.to_dict() for st in hub.gpus.all()],
        "missing": [{"gpu": m.name, "match": m.match, "why": m.why} for m in hub.gpus.missing()],
        # per GPU: the profile, whether it read back equal, and the effective-clock
        # findings ("profile applied but card runs at 1233 MHz", INCIDENTS §3)
        "profiles": jsonable(hub.view("profiles") or {}),
        # which processes hold each GPU (pid, comm, engine, VRAM), from the engine
        # watchdog's DRM fdinfo / NVML scan; absent when no watchdog runs (engines: [])
        "gpu_processes": jsonable(hub.view("gpu_processes") or {"scanned_at": None, "processes": []}),
    }


def summary_line(hub: Hub) -> str:
    snap = hub.snapshot
    if snap is None:
        return "starting: no poll yet"
    if hub.gpus.observed:
        # configured vs present, missing cards named (state/gpus.py; INCIDENTS §2)
        line = hub.gpus.summary()
    else:  # a snapshot published without discovery (a test's hand-made hub)
        down = [g.name for g in snap.gpus if not g.up]
        line = f"{sum(1 for g in snap.gpus if g.up)}/{len(snap.gpus)} GPUs up" + (f"; down: {', '.join(down)}" if down else "")
    notes = [n for _, n in sorted(hub.notes.items()) if n]
    return "; ".join([line] + notes)


# -- request bodies ------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReasonBody(_Body):
    reason: str | None = Field(None, max_length=500, description="why; goes to the audit log")


class ApplyBody(ReasonBody):
    profile: str = Field(pattern=NAME_RE.pattern, description="a configured profile name")
    confirm_within: float | None = Field(
        None, ge=1, le=3600, description="revert unless POST .../confirm arrives within this many seconds"
    )


@dataclass
class ActionContext:
    """What the audit record of one mutating call says, filled in as the call proceeds."""

    target: str
    reason: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    # called by each action right before it changes anything: writes the audit record
    # first and raises 503 when it cannot
    before_act: Callable[[], None] = lambda: None

    @property
    def why(self) -> str:
        return self.reason or "API request (no reason given)"


def _body_doc(model: type[BaseModel], required: bool) -> dict[str, Any]:
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": model.model_json_schema()}}}}


MAX_BODY_DEPTH = 16  # the bodies are flat objects; deep nesting is only an attack


def json_depth(raw: bytes, limit: int) -> int:
    """Deepest [/{ nesting of a JSON text (strings skipped), counted before parsing so a
    deep body never reaches the recursive parser (it answered 500). Stops
    counting past `limit`."""
    depth = deepest = 0
    in_str = esc = False
    for b in raw:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:  # backslash
                esc = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif b in (0x5D, 0x7D):
            depth -= 1
    return deepest


async def parse_body(request: Request, model: type[_Body]) -> _Body:
    """Parse after auth (FastAPI's own body handling would answer 422 before 401). An
    empty body is `{}`; errors are 422 with the field's location. Size is bounded by
    BodyLimit (413) before this runs; depth here (422), before json.loads."""
    raw = await request.body()
    data: Any = {}
    if raw.strip():
        if json_depth(raw, MAX_BODY_DEPTH) > MAX_BODY_DEPTH:
            raise HTTPException(422, detail=[{"loc": ["body"], "msg": f"nested deeper than {MAX_BODY_DEPTH} levels",
                                              "type": "json_too_deep"}])
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise HTTPException(422, detail=[{"loc": ["body"], "msg": f"not valid JSON: {e}", "type": "json_invalid"}])
    if not isinstance(data, dict):
        raise HTTPException(422, detail=[{"loc": ["body"], "msg": "must be a JSON object", "type": "model_type"}])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        detail = [
            {"loc": ["body", *e_["loc"]], "msg": e_["msg"], "type": e_["type"]}
            for e_ in e.errors(include_url=False, include_input=False, include_context=False)
        ]
        raise HTTPException(422, detail=detail) from None


# -- body size limit (pure ASGI: runs before FastAPI reads anything) -----------------------
class BodyLimit:
    """413 for a body over the limit: by Content-Length without reading it, or (chunked)
    as soon as the buffered bytes pass the limit. The limit is read per request so a
    reload takes effect at once."""

    def __init__(self, app: Any, limit: Callable[[], int]) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit()
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        cl = headers.get(b"content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                return await self._answer(send, 400, "Content-Length is not a number")
            if n > limit:
                return await self._answer(send, 413, f"request body is {n} bytes; the limit is {limit} (api.max_body_bytes)")
            if n == 0:
                return await self.app(scope, receive, send)
        elif b"transfer-encoding" not in headers:
            return await self.app(scope, receive, send)
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # client went away
            body += msg.get("body", b"")
            if len(body) > limit:
                return await self._answer(send, 413, f"request body is over the limit of {limit} bytes (api.max_body_bytes)")
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _answer(send: Callable, status: int, detail: str) -> None:
        data = json.dumps({"detail": detail}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": data})


# -- access --------------------------------------------------------------------------------
def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(401, detail=detail, headers={"WWW-Authenticate": 'Bearer realm="gpuguard"'})


def _caller(request: Request) -> Caller:
    tokens: TokenStore = request.app.state.tokens
    presented = bearer_token(request.headers.get("authorization"))
    if presented is None:
        raise _unauthorized("this call needs a bearer token: send 'Authorization: Bearer <token>' (tokens live in api.token_file)")
    if len(tokens) == 0:
        raise _unauthorized("no API tokens are configured (set api.token_file); the control API refuses every change")
    name = tokens.match(presented)
    if name is None:
        raise _unauthorized("token not recognised")
    return Caller(name)


def require_token(request: Request) -> Caller:
    try:
        return _caller(request)
    except HTTPException:
        client = request.client.host if request.client else "?"
        log.warning("api refused method=%s path=%r client=%s reason=unauthenticated", request.method, request.url.path, client)
        raise


def read_access(request: Request) -> None:
    policy: AccessPolicy = request.app.state.policy
    if policy.reads_need_token:
        require_token(request)


def check_name(kind: str, value: str) -> str:
    """A path parameter is a name, never a path: refuse anything that is not NAME_RE."""
    if not NAME_RE.match(value) or value in (".", ".."):
        raise HTTPException(404, detail=f"no {kind} named {value!r}")
    return value


async def _call(fn: Callable[..., Any], *args: Any, blocking: bool) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    if blocking:  # hardware writes, kills: never on the loop
        return await asyncio.to_thread(fn, *args)
    r = fn(*args)
    return await r if inspect.isawaitable(r) else r


def _need(actions: Actions, *names: str) -> list[Callable[..., Any]]:
    missing = [n for n in names if getattr(actions, n) is None]
    if missing:
        raise HTTPException(
            501, detail=f"no provider is registered for {', '.join(missing)} (that part of gpuguard is not running here)"
        )
    return [getattr(actions, n) for n in names]


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
    register providers on `app.state.actions`."""
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
    confirm = ConfirmWindows(hub, audit, lambda: app.state.actions.restore_state)
    app.state.confirm = confirm
    app.add_middleware(BodyLimit, limit=lambda: app.state.max_body_bytes)

    read = [Depends(read_access)]

    def actions_() -> Actions:
        return app.state.actions

    def known_gpu(gpu: str) -> str:
        check_name("GPU", gpu)
        snap = hub.snapshot
        g = snap.gpu(gpu) if snap else None
        if g is None:
            raise HTTPException(404, detail=f"no GPU named {gpu!r}")
        return g.name

    def listed_names(provider: str) -> set[str]:
        fn = getattr(actions_(), provider)
        items = fn() if fn is not None else []
        return {i if isinstance(i, str) else str(i.get("name")) for i in items}

    def known(kind: str, value: str, provider: str) -> str:
        check_name(kind, value)
        if value not in listed_names(provider):
            raise HTTPException(404, detail=f"no {kind} named {value!r}")
        return value

    async def audited(
        request: Request,
        caller: Caller,
        what: str,
        ctx: ActionContext,
        run: Callable[[], Awaitable[tuple[Any, dict[str, Any] | None]]],
    ) -> dict[str, Any]:
        """Run one mutating action and audit it whatever happens. `run` fills `ctx`
        (the resolved target, the reason from the body, evidence) as it learns them."""
        ctx.evidence["client"] = request.client.host if request.client else None
        ctx.before_act = lambda: write_ahead(what, caller, ctx)
        try:
            result, pending = await run()
        except HTTPException as e:
            _audit(what, caller, ctx, f"refused {e.status_code}: {e.detail}")
            raise
        except ActionRefused as e:
            _audit(what, caller, ctx, f"refused: {e}")
            raise HTTPException(409, detail=str(e)) from None
        except LookupError as e:
            _audit(what, caller, ctx, f"unknown: {e}")
            raise HTTPException(404, detail=str(e)) from None
        except Exception as e:
            log.error("api action=%s target=%s who=%s failed: %s: %s", what, ctx.target, caller.who, type(e).__name__, e)
            _audit(what, caller, ctx, f"failed: {type(e).__name__}: {e}")
            raise HTTPException(500, detail=f"{what} on {ctx.target} failed: {type(e).__name__}: {e}") from None
        ctx.evidence["provider_result"] = result
        _audit(what, caller, ctx, "ok")
        log.info("api action=%s target=%s who=%s why=%r ok", what, ctx.target, caller.who, ctx.why)
        return {"ok": True, "action": what, "target": ctx.target, "who": caller.who, "result": jsonable(result),
                "pending_confirm": pending}

    def write_ahead(what: str, caller: Caller, ctx: ActionContext) -> None:
        """The audit record, written and fsynced before the action acts. No record, no
        action: 503, an alert, and nothing reaches the provider."""
        audit = app.state.audit
        if audit is None:
            return
        try:
            audit.record(what, caller.who, ctx.why, target=ctx.target, evidence=ctx.evidence, result="started",
                         required=True)
        except AuditUnavailable as e:
            msg = f"{what} on {ctx.target} refused: {e}; nothing was changed (free space or fix state_dir, then retry)"
            hub.publish(Event("audit_unavailable", "alert", "api", msg, fields={"action": what, "target": ctx.target,
                                                                               "who": caller.who}))
            raise HTTPException(503, detail=msg) from None

    def _audit(what: str, caller: Caller, ctx: ActionContext, result: str) -> None:
        if app.state.audit is not None:
            app.state.audit.record(what, caller.who, ctx.why, target=ctx.target, evidence=ctx.evidence, result=result)
        else:
            log.warning("audit log not configured: action=%s target=%s who=%s result=%s", what, ctx.target, caller.who, result)

    def gpu_evidence(name: str) -> dict[str, Any]:
        snap = hub.snapshot
        g = snap.gpu(name) if snap else None
        if g is None:
            return {}
        return {"gpu": {"bdf": g.bdf, "up": g.up, "power_watts": g.power_watts, "power_cap_watts": g.power_cap_watts,
                        "od": None if g.od is None else dict(g.od.settings)}}

    # -- reads ---------------------------------------------------------------------------
    @app.get("/metrics", include_in_schema=False, dependencies=read)
    def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        last = hub.last_poll.get("gpu")
        doc: dict[str, Any] = {"ok": hub.poll_fresh(), "last_poll": last}
        state = getattr(app.state, "state_health", None)
        if state is not None:  # telemetry runs without it; audited actions do not
            doc["state_dir"] = state().to_dict()
        return doc

    @app.get("/v1/status", dependencies=read)
    def get_status() -> dict[str, Any]:
        doc = status_document(hub)
        doc["pending_confirm"] = {g: p.to_dict() for g, p in confirm.pending.items()}
        return doc

    @app.get("/v1/gpus", dependencies=read)
    def get_gpus() -> list[dict[str, Any]]:
        snap = hub.snapshot
        return [g.to_dict() for g in snap.gpus] if snap else []

    @app.get("/v1/gpus/{gpu}", dependencies=read)
    def get_gpu(gpu: str) -> dict[str, Any]:
        name = known_gpu(gpu)
        return hub.snapshot.gpu(name).to_dict()

    @app.get("/v1/events", dependencies=read)
    def get_events(
        since: float | None = Query(None, description="unix time; events at or after it"),
        limit: int = Query(1000, ge=1, le=10000, description="the newest N"),
    ) -> list[dict[str, Any]]:
        return [e.to_dict() for e in hub.recent_events(since)][-limit:]

    def provided(name: str) -> Any:
        (fn,) = _need(actions_(), name)
        doc = fn()
        if doc is None:  # the provider runs but has nothing yet (first walk, first scan)
            raise HTTPException(503, detail=f"{name}: not available yet; try again in a few seconds")
        return doc

    @app.get("/v1/engines", dependencies=read)
    def get_engines() -> list[dict[str, Any]]:
        return jsonable(list(provided("engines")))

    @app.get("/v1/incidents", dependencies=read)
    def get_incidents() -> list[dict[str, Any]]:
        return jsonable(list(provided("incidents")))

    @app.get("/v1/profiles", dependencies=read)
    def get_profiles() -> list[dict[str, Any]]:
        return jsonable(list(provided("profiles")))

    @app.get("/v1/pcie", dependencies=read)
    def get_pcie() -> dict[str, Any]:
        return jsonable(provided("pcie"))

    @app.get("/v1/power", dependencies=read)
    def get_power() -> dict[str, Any]:
        return jsonable(provided("power"))

    @app.get("/v1/config", dependencies=read)
    def get_config() -> dict[str, Any]:
        view = app.state.config_view
        if view is None:
            raise HTTPException(501, detail="this server was started without a config")
        return view()

    # -- actions -------------------------------------------------------------------------
    @app.post("/v1/gpus/{gpu}/apply", openapi_extra=_body_doc(ApplyBody, True))
    async def post_apply(gpu: str, request: Request, caller: Caller = Depends(require_token)) -> dict[str, Any]:
        """Apply a profile (provider: apply + read back). With `confirm_within` the state
        before is restored unless POST .../confirm arrives in time."""
        ctx = ActionContext(gpu)

        async def run() -> tuple[Any, dict | None]:
            ctx.target = name = known_gpu(gpu)
            body = await parse_body(request, ApplyBody)
            assert isinstance(body, ApplyBody)
            ctx.reason = body.reason
            ctx.evidence.update(gpu_evidence(name), request={"profile": body.profile, "confirm_within": body.confirm_within})
            acts = actions_()
            if acts.profiles is not None and body.profile not in listed_names("profiles"):
                raise HTTPException(422, detail=[{"loc": ["body", "profile"], "msg": f"no profile named {body.profile!r}",
                                                  "type": "value_error"}])
            (apply,) = _need(acts, "apply_profile")
            state = None
            if body.confirm_within is not None:
                snapshot_state, _ = _need(acts, "snapshot_state", "restore_state")
                state = confirm.state_before(name)
                if state is None:
                    state = await _call(snapshot_state, name, blocking=True)
                ctx.evidence["state_before"] = state
            ctx.before_act()
            result = await _call(apply, name, body.profile, caller.who, blocking=True)
            pending = None
            if body.confirm_within is not None:
                pending = confirm.open(name, body.profile, caller.who, state, body.confirm_within).to_dict()
            elif confirm.has(name):
                confirm.confirm(name)  # an apply without a window is itself a confirmation
            return result, pending

        return await audited(request, caller, "gpu.apply", ctx, run)

    @app.post("/v1/gpus/{gpu}/confirm", openapi_extra=_body_doc(ReasonBody, False))
    async def post_confirm(gpu: str, request: Request, caller: Caller = Depends(require_token)) -> dict[str, Any]:
        """Keep the profile applied with `confirm_within` (stops its revert timer)."""
        ctx = ActionContext(gpu)

        async def run() -> tuple[Any, dict | None]:
            ctx.target = name = known_gpu(gpu)
            ctx.reason = (await parse_body(request, ReasonBody)).reason
            if not confirm.has(name):
                raise HTTPException(409, detail=f"GPU {name!r} has no applied profile waiting for confirmation")
            ctx.before_act()
            p = confirm.confirm(name)
            if p is None:
                raise HTTPException(409, detail=f"GPU {name!r} has no applied profile waiting for confirmation")
            return {"confirmed": p.to_dict()}, None

        return await audited(request, caller, "gpu.confirm", ctx, run)

    def simple_action(what: str, kind: str, provider: str, lister: str | None) -> Callable[..., Awaitable[dict]]:
        """kill/restart/quarantine/reset: name check, body {"reason"}, provider(name, who)."""

        async def endpoint(name: str, request: Request, caller: Caller) -> dict[str, Any]:
            ctx = ActionContext(name)

            async def run() -> tuple[Any, dict | None]:
                if lister is None:
                    ctx.target = known_gpu(name)
                    ctx.evidence.update(gpu_evidence(ctx.target))
                else:
                    _need(actions_(), provider, lister)
                    ctx.target = known(kind, name, lister)
                    if lister == "engines":  # what the engine looked like when the kill was asked for
                        ctx.evidence["engine"] = next(
                            (e for e in actions_().engines() if isinstance(e, dict) and e.get("name") == ctx.target), None
                        )
                ctx.reason = (await parse_body(request, ReasonBody)).reason
                (fn,) = _need(actions_(), provider)
                ctx.before_act()
                return await _call(fn, ctx.target, caller.who, blocking=True), None

            return await audited(request, caller, what, ctx, run)

        return endpoint

    reset = simple_action("gpu.reset", "GPU", "reset_gpu", None)
    kill = simple_action("engine.kill", "engine", "kill_engine", "engines")
    restart = simple_action("engine.restart", "engine", "restart_engine", "engines")
    quarantine = simple_action("cache.quarantine", "cache", "quarantine_cache", "caches")

    @app.post("/v1/gpus/{gpu}/reset", openapi_extra=_body_doc(ReasonBody, False))
    async def post_reset(gpu: str, request: Request, caller: Caller = Depends(require_token)) -> dict[str, Any]:
        """Back to stock OD values and the default power cap (never a PCI reset)."""
        return await reset(gpu, request, caller)

    @app.post("/v1/engines/{engine}/kill", openapi_extra=_body_doc(ReasonBody, False))
    async def post_kill(engine: str, request: Request, caller: Caller = Depends(require_token)) -> dict[str, Any]:
        return await kill(engine, request, caller)

    @app.post("/v1/engines/{engine}/restart", openapi_extra=_body_doc(ReasonBody, False))
    async def post_restart(engine: str, request: Request, caller: Caller = Depends(require_token)) -> dict[str, Any]:
        return await restart(engine, request, caller)

    @app.post("/v1/caches/{cache}/quarantine", openapi_extra=_body_doc(ReasonBody, False))
    async def post_quarantine(cache: str, request: Request, caller: Caller = Depends(require_token)) -> dict[str, Any]:
        """Rename the cache folder aside, never delete it (INCIDENTS §7)."""
        return await quarantine(cache, request, caller)

    return app
