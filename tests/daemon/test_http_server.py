"""The daemon's uvicorn server without uvicorn's 10 Hz tick: the Date header is still
refreshed (once a second, as uvicorn does), and stop() ends serving at once."""
from __future__ import annotations

import asyncio
import email.utils
import time

import httpx
import uvicorn

from gpuguard.daemon import _Server


async def app(scope, receive, send):
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_date_header_is_fresh_and_stop_ends_serving_at_once():
    async def main():
        server = _Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient() as c:
            first = (await c.get(f"http://127.0.0.1:{port}/")).headers["date"]
            await asyncio.sleep(2.2)  # two refreshes later
            second = (await c.get(f"http://127.0.0.1:{port}/")).headers["date"]
        t0 = time.monotonic()
        server.stop()
        await asyncio.wait_for(task, 5)
        return first, second, time.monotonic() - t0

    first, second, stop_s = asyncio.run(main())
    a, b = (email.utils.parsedate_to_datetime(d).timestamp() for d in (first, second))
    assert b - a >= 1, (first, second)  # refreshed, not the start-up value
    assert abs(b - time.time()) < 5
    # woken by stop(), not by the next one-second refresh (uvicorn's loop took up to 0.1 s)
    assert stop_s < 0.5, stop_s


def test_start_up_objects_are_frozen_out_of_full_collections():
    """A full collection walks only what was made after start-up (the slowest scrapes were
    the ones a gen-2 collection of every imported model landed in)."""
    import gc

    from gpuguard.daemon import freeze_start_up_objects

    try:
        frozen = freeze_start_up_objects()
        assert frozen > 10_000 and gc.get_freeze_count() == frozen
        assert len(gc.get_objects(generation=2)) < frozen / 10
    finally:
        gc.unfreeze()
