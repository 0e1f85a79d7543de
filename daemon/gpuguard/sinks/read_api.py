"""The API's read routes: `/healthz` and the GETs under `/v1/` (`/metrics` is answered
ahead of any routing, sinks/api.py). Each serves the hub's latest state or a provider's
in-memory view (control/actions.py read providers) and never touches hardware.
`/healthz` is always open; the others need a token when the daemon listens beyond
loopback without `api.open_reads` (control/access.py).

Plain Starlette routes, not FastAPI: the reads are what a host does all day (the page,
`gpuguard status`, scripts), and FastAPI with the models it builds is 11 MiB and a
third of a request's CPU (issue 15); the control routes stay FastAPI (control/routes.py).
Query parameters are validated by pydantic models and refused the way FastAPI refuses
them: 422, `{"detail": [{"loc": ["query", NAME], "msg", "type"}]}`."""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gpuguard.control.access import known_gpu, need, read_access
from gpuguard.control.bodies import unprocessable
from gpuguard.sinks.status import status_document
from gpuguard.state.audit import jsonable


class Query(BaseModel):
    """A route's query parameters; unknown ones are ignored (as FastAPI does)."""

    model_config = ConfigDict(extra="ignore", frozen=True)


def query(request: Request, model: type[Query]) -> Any:
    """The request's query parameters as `model`; 422 naming each bad one."""
    try:
        return model.model_validate(dict(request.query_params))
    except ValidationError as e:
        raise unprocessable(e, "query") from None


def read_route(path: str, fn: Callable[[Request], Any], *, open_: bool = False, blocking: bool = False) -> Route:
    """GET `path` answered by `fn(request)`: a Response, or a document sent as JSON.
    `blocking` runs it on asyncio's thread pool (disk, SQLite); in-memory reads run on the
    loop (a thread handoff costs more than they do). Not Starlette's run_in_threadpool:
    anyio's backend and worker thread were 1.1 MiB of RSS from the first read on (issue 15).
    Not `open_`: the read access rule first."""

    async def endpoint(request: Request) -> Response:
        if not open_:
            read_access(request)
        doc = await asyncio.to_thread(fn, request) if blocking else fn(request)
        return doc if isinstance(doc, Response) else JSONResponse(doc)

    return Route(path, endpoint, methods=["GET"], name=getattr(fn, "__name__", path))


def healthz(request: Request) -> dict[str, Any]:
    hub = request.app.state.hub
    last = hub.last_poll.get("gpu")
    doc: dict[str, Any] = {"ok": hub.poll_fresh(), "last_poll": last}
    state = getattr(request.app.state, "state_health", None)
    if state is not None:  # telemetry runs without it; audited actions do not
        doc["state_dir"] = state().to_dict()
    return doc


def get_status(request: Request) -> dict[str, Any]:
    doc = status_document(request.app.state.hub)
    doc["pending_confirm"] = {g: p.to_dict() for g, p in request.app.state.confirm.pending.items()}
    return doc


def get_gpus(request: Request) -> list[dict[str, Any]]:
    snap = request.app.state.hub.snapshot
    return [g.to_dict() for g in snap.gpus] if snap else []


def get_gpu(request: Request) -> dict[str, Any]:
    name = known_gpu(request, request.path_params["gpu"])
    return request.app.state.hub.snapshot.gpu(name).to_dict()


class EventsQuery(Query):
    since: float | None = Field(None, description="unix time; events at or after it")
    limit: int = Field(1000, ge=1, le=10000, description="the newest N")


def get_events(request: Request) -> list[dict[str, Any]]:
    q = query(request, EventsQuery)
    return [e.to_dict() for e in request.app.state.hub.recent_events(q.since)][-q.limit:]


def _provided(request: Request, name: str) -> Any:
    (fn,) = need(request.app.state.actions, name)
    doc = fn()
    if doc is None:  # the provider runs but has nothing yet (first walk, first scan)
        raise HTTPException(503, detail=f"{name}: not available yet; try again in a few seconds")
    return doc


def provided_list(name: str) -> Callable[[Request], list[dict[str, Any]]]:
    def get(request: Request) -> list[dict[str, Any]]:
        return jsonable(list(_provided(request, name)))

    get.__name__ = f"get_{name}"
    return get


def provided_doc(name: str) -> Callable[[Request], dict[str, Any]]:
    def get(request: Request) -> dict[str, Any]:
        return jsonable(_provided(request, name))

    get.__name__ = f"get_{name}"
    return get


def get_config(request: Request) -> dict[str, Any]:
    view = request.app.state.config_view
    if view is None:
        raise HTTPException(501, detail="this server was started without a config")
    return view()


# Providers that list engines, incidents or profiles may look at the disk or /proc: on the
# thread pool, as FastAPI ran these plain-def routes before.
ROUTES = [
    read_route("/healthz", healthz, open_=True, blocking=True),
    read_route("/v1/status", get_status, blocking=True),
    read_route("/v1/gpus", get_gpus),
    read_route("/v1/gpus/{gpu}", get_gpu),
    read_route("/v1/events", get_events),
    read_route("/v1/engines", provided_list("engines"), blocking=True),
    read_route("/v1/incidents", provided_list("incidents"), blocking=True),
    read_route("/v1/profiles", provided_list("profiles"), blocking=True),
    read_route("/v1/pcie", provided_doc("pcie"), blocking=True),
    read_route("/v1/power", provided_doc("power"), blocking=True),
    read_route("/v1/config", get_config, blocking=True),
]
