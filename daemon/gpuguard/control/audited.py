"""One mutating API call, audited whatever happens: the record is written and fsynced
before the action acts (no record, no action: 503, an alert, and nothing reaches the
provider), and its outcome is recorded after — ok, refused (409), unknown (404), failed
(500) or interrupted by the daemon's stop (503) — with the token's name, the reason from the body and the evidence."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request

from gpuguard.control.actions import ActionRefused
from gpuguard.control.auth import Caller
from gpuguard.state.audit import AuditUnavailable, jsonable
from gpuguard.state.events import Event

log = logging.getLogger("gpuguard.api")


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
    ctx.before_act = lambda: _write_ahead(request, what, caller, ctx)
    try:
        result, pending = await run()
    except HTTPException as e:
        _audit(request, what, caller, ctx, f"refused {e.status_code}: {e.detail}")
        raise
    except ActionRefused as e:
        _audit(request, what, caller, ctx, f"refused: {e}")
        raise HTTPException(409, detail=str(e)) from None
    except LookupError as e:
        _audit(request, what, caller, ctx, f"unknown: {e}")
        raise HTTPException(404, detail=str(e)) from None
    except asyncio.CancelledError:
        # SIGTERM while the action waits on a card or a process: the client must not get a
        # bare 500, and the audit log must not end at "started".
        unknown = "card state unknown, re-read it (gpuguard status)" if what.startswith("gpu.") else \
            "its outcome is unknown, re-read it (gpuguard engines)"
        msg = f"gpuguard is shutting down: {what} on {ctx.target} not finished: {unknown}"
        log.warning("api action=%s target=%s who=%s interrupted by shutdown", what, ctx.target, caller.who)
        _audit(request, what, caller, ctx, f"interrupted: {msg}")
        raise HTTPException(503, detail=msg) from None
    except Exception as e:
        log.error("api action=%s target=%s who=%s failed: %s: %s", what, ctx.target, caller.who, type(e).__name__, e)
        _audit(request, what, caller, ctx, f"failed: {type(e).__name__}: {e}")
        raise HTTPException(500, detail=f"{what} on {ctx.target} failed: {type(e).__name__}: {e}") from None
    ctx.evidence["provider_result"] = result
    _audit(request, what, caller, ctx, "ok")
    log.info("api action=%s target=%s who=%s why=%r ok", what, ctx.target, caller.who, ctx.why)
    return {"ok": True, "action": what, "target": ctx.target, "who": caller.who, "result": jsonable(result),
            "pending_confirm": pending}


def _write_ahead(request: Request, what: str, caller: Caller, ctx: ActionContext) -> None:
    """The audit record, written and fsynced before the action acts."""
    audit = request.app.state.audit
    if audit is None:
        return
    try:
        audit.record(what, caller.who, ctx.why, target=ctx.target, evidence=ctx.evidence, result="started",
                     required=True)
    except AuditUnavailable as e:
        msg = f"{what} on {ctx.target} refused: {e}; nothing was changed (free space or fix state_dir, then retry)"
        request.app.state.hub.publish(Event("audit_unavailable", "alert", "api", msg,
                                            fields={"action": what, "target": ctx.target, "who": caller.who}))
        raise HTTPException(503, detail=msg) from None


def _audit(request: Request, what: str, caller: Caller, ctx: ActionContext, result: str) -> None:
    audit = request.app.state.audit
    if audit is not None:
        audit.record(what, caller.who, ctx.why, target=ctx.target, evidence=ctx.evidence, result=result)
    else:
        log.warning("audit log not configured: action=%s target=%s who=%s result=%s", what, ctx.target, caller.who, result)
