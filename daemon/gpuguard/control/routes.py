"""The API's action routes (POST under `/v1/`): apply / confirm / reset a GPU, kill or
restart an engine, quarantine a cache. Each needs a bearer token (401), checks its path
name (404), parses its body (422), finds its provider (501), and runs audited
(control/audited.py): 503 when the audit record cannot be written first, 409 refused,
404 unknown to the provider. The work itself is the providers' (control/actions.py).
Hardware writes and kills run in a worker thread unless the provider is a coroutine."""
from __future__ import annotations

import asyncio
import inspect
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Depends
from starlette.exceptions import HTTPException
from starlette.requests import Request

from gpuguard.control.access import check_name, known_gpu, need, require_token
from gpuguard.control.actions import Actions
from gpuguard.control.audited import ActionContext, audited
from gpuguard.control.auth import Caller
from gpuguard.control.bodies import ApplyBody, ReasonBody, body_doc, parse_body
from gpuguard.control.paths import APPLY, CONFIRM, KILL, QUARANTINE, RESET, RESTART

router = APIRouter()


async def _call(fn: Callable[..., Any], *args: Any, blocking: bool) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    if blocking:  # hardware writes, kills: never on the loop
        return await asyncio.to_thread(fn, *args)
    r = fn(*args)
    return await r if inspect.isawaitable(r) else r


def _actions(request: Request) -> Actions:
    return request.app.state.actions


def _listed_names(request: Request, provider: str) -> set[str]:
    fn = getattr(_actions(request), provider)
    items = fn() if fn is not None else []
    return {i if isinstance(i, str) else str(i.get("name")) for i in items}


def _known(request: Request, kind: str, value: str, provider: str) -> str:
    check_name(kind, value)
    if value not in _listed_names(request, provider):
        raise HTTPException(404, detail=f"no {kind} named {value!r}")
    return value


def _gpu_evidence(request: Request, name: str) -> dict[str, Any]:
    snap = request.app.state.hub.snapshot
    g = snap.gpu(name) if snap else None
    if g is None:
        return {}
    return {"gpu": {"bdf": g.bdf, "up": g.up, "power_watts": g.power_watts, "power_cap_watts": g.power_cap_watts,
                    "od": None if g.od is None else dict(g.od.settings)}}


@router.post(APPLY, openapi_extra=body_doc(ApplyBody, True))
async def post_apply(gpu: str, request: Request, caller: Caller = Depends(require_token)) -> dict[str, Any]:
    """Apply a profile (provider: apply + read back). With `confirm_within` the state
    before is restored unless POST .../confirm arrives in time."""
    ctx = ActionContext(gpu)
    confirm = request.app.state.confirm

    async def run() -> tuple[Any, dict | None]:
        ctx.target = name = known_gpu(request, gpu)
        body = await parse_body(request, ApplyBody)
        assert isinstance(body, ApplyBody)
        ctx.reason = body.reason
        ctx.evidence.update(_gpu_evidence(request, name),
                            request={"profile": body.profile, "confirm_within": body.confirm_within})
        acts = _actions(request)
        if acts.profiles is not None and body.profile not in _listed_names(request, "profiles"):
            raise HTTPException(422, detail=[{"loc": ["body", "profile"], "msg": f"no profile named {body.profile!r}",
                                              "type": "value_error"}])
        (apply,) = need(acts, "apply_profile")
        async with confirm.sequence(name):  # the state before is read with no other apply between
            state = None
            if body.confirm_within is not None:
                snapshot_state, _ = need(acts, "snapshot_state", "restore_state")
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


@router.post(CONFIRM, openapi_extra=body_doc(ReasonBody, False))
async def post_confirm(gpu: str, request: Request, caller: Caller = Depends(require_token)) -> dict[str, Any]:
    """Keep the profile applied with `confirm_within` (stops its revert timer)."""
    ctx = ActionContext(gpu)
    confirm = request.app.state.confirm

    async def run() -> tuple[Any, dict | None]:
        ctx.target = name = known_gpu(request, gpu)
        ctx.reason = (await parse_body(request, ReasonBody)).reason
        if not confirm.has(name):
            raise HTTPException(409, detail=f"GPU {name!r} has no applied profile waiting for confirmation")
        ctx.before_act()
        p = confirm.confirm(name)
        if p is None:
            raise HTTPException(409, detail=f"GPU {name!r} has no applied profile waiting for confirmation")
        return {"confirmed": p.to_dict()}, None

    return await audited(request, caller, "gpu.confirm", ctx, run)


def _simple_action(what: str, kind: str, provider: str, lister: str | None) -> Callable[..., Awaitable[dict]]:
    """kill/restart/quarantine/reset: name check, body {"reason"}, provider(name, who)."""

    async def endpoint(name: str, request: Request, caller: Caller) -> dict[str, Any]:
        ctx = ActionContext(name)

        async def run() -> tuple[Any, dict | None]:
            acts = _actions(request)
            if lister is None:
                ctx.target = known_gpu(request, name)
                ctx.evidence.update(_gpu_evidence(request, ctx.target))
            else:
                need(acts, provider, lister)
                ctx.target = _known(request, kind, name, lister)
                if lister == "engines":  # what the engine looked like when the kill was asked for
                    ctx.evidence["engine"] = next(
                        (e for e in acts.engines() if isinstance(e, dict) and e.get("name") == ctx.target), None
                    )
            ctx.reason = (await parse_body(request, ReasonBody)).reason
            (fn,) = need(_actions(request), provider)
            ctx.before_act()
            return await _call(fn, ctx.target, caller.who, blocking=True), None

        return await audited(request, caller, what, ctx, run)

    return endpoint


_reset = _simple_action("gpu.reset", "GPU", "reset_gpu", None)
_kill = _simple_action("engine.kill", "engine", "kill_engine", "engines")
_restart = _simple_action("engine.restart", "engine", "restart_engine", "engines")
_quarantine = _simple_action("cache.quarantine", "cache", "quarantine_cache", "caches")


@router.post(RESET, openapi_extra=body_doc(ReasonBody, False))
async def post_reset(gpu: str, request: Request, caller: Caller = Depends(require_token)) -> dict[str, Any]:
    """Back to stock OD values and the default power cap (never a PCI reset)."""
    return await _reset(gpu, request, caller)


@router.post(KILL, openapi_extra=body_doc(ReasonBody, False))
async def post_kill(engine: str, request: Request, caller: Caller = Depends(require_token)) -> dict[str, Any]:
    return await _kill(engine, request, caller)


@router.post(RESTART, openapi_extra=body_doc(ReasonBody, False))
async def post_restart(engine: str, request: Request, caller: Caller = Depends(require_token)) -> dict[str, Any]:
    return await _restart(engine, request, caller)


@router.post(QUARANTINE, openapi_extra=body_doc(ReasonBody, False))
async def post_quarantine(cache: str, request: Request, caller: Caller = Depends(require_token)) -> dict[str, Any]:
    """Rename the cache folder aside, never delete it (INCIDENTS §7)."""
    return await _quarantine(cache, request, caller)
