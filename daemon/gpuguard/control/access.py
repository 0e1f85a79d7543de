"""What every API route checks before it answers or acts, as plain functions of the
request (the action routes use them as FastAPI dependencies) and helpers shared by the read routes (sinks/read_api.py) and the action routes
(control/routes.py): the caller's bearer token (control/auth.py), whether reads need one
here, that a path parameter is a name and a known one, and that a provider is registered.

Path parameters are names, never paths: each must match NAME_RE and be one of the known
GPUs / engines / caches before anything else sees it.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request

from gpuguard.control.actions import Actions
from gpuguard.control.auth import AccessPolicy, Caller, TokenStore, bearer_token

log = logging.getLogger("gpuguard.api")

# GPU names follow config's GpuEntry pattern; PCI addresses (0000:05:00.0) fit too.
NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


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
    """401 when reads need a token here and the request has none that matches."""
    policy: AccessPolicy = request.app.state.policy
    if policy.reads_need_token:
        require_token(request)


def check_name(kind: str, value: str) -> str:
    """A path parameter is a name, never a path: refuse anything that is not NAME_RE."""
    if not NAME_RE.match(value) or value in (".", ".."):
        raise HTTPException(404, detail=f"no {kind} named {value!r}")
    return value


def known_gpu(request: Request, gpu: str) -> str:
    """The configured name of the GPU a path names (by name or PCI address); 404 otherwise."""
    check_name("GPU", gpu)
    snap = request.app.state.hub.snapshot
    g = snap.gpu(gpu) if snap else None
    if g is None:
        raise HTTPException(404, detail=f"no GPU named {gpu!r}")
    return g.name


def need(actions: Actions, *names: str) -> list[Callable[..., Any]]:
    """The providers for `names`; 501 naming the missing ones."""
    missing = [n for n in names if getattr(actions, n) is None]
    if missing:
        raise HTTPException(
            501, detail=f"no provider is registered for {', '.join(missing)} (that part of gpuguard is not running here)"
        )
    return [getattr(actions, n) for n in names]
