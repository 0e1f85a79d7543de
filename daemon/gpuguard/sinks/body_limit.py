"""The API's request body limit (`api.max_body_bytes`), as pure ASGI middleware: it runs
before FastAPI reads anything, so an oversized body is refused (413) before it is parsed,
authenticated or buffered whole."""
from __future__ import annotations

import json
from typing import Any, Callable

DEFAULT_MAX_BODY = 65536


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
