"""Helpers shared by tests (importable: pytest puts tests/ on sys.path)."""
from __future__ import annotations

import errno as errno_mod
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Callable

from gpuguard.hw.sysfs import SysfsError, SysfsRoot


# How long a daemon or a simulated engine may take to start its processes and be watched:
# seconds on a quiet machine, over 15 s on 2 loaded cores (seen with mutation runs beside
# the suite). A wait that returns as soon as the thing is there, never a bound on gpuguard.
STARTS = 60


def api_routes(app) -> list:
    """Every path operation of the daemon's app (sinks/api.Api: its Starlette read routes
    and its FastAPI control app's routes) or of a FastAPI app, whatever routers it was put
    together from: FastAPI 0.137.2 and later keep an included router as one node of
    `app.routes` (`iter_route_contexts` flattens them), older ones copy its routes in.
    Each item has `.path`, `.methods` and `.path_regex`."""
    from fastapi.routing import APIRoute
    from starlette.routing import Route

    if hasattr(app, "reads"):
        return [r for r in app.reads.routes if isinstance(r, Route)] + api_routes(app.control())

    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:
        return [r for r in app.routes if isinstance(r, APIRoute)]
    return [c for c in iter_route_contexts(app.routes) if isinstance(c.original_route, APIRoute)]


def poll_until(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition", interval: float = 0.02):
    """Poll `cond` until it returns something truthy (returned) or the deadline passes.
    Synchronisation by condition, never by a fixed sleep."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = cond()
        except Exception as e:  # what we wait for may not answer yet
            last = e
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class WebhookReceiver:
    """A real HTTP server on loopback that records every POSTed webhook body with the
    time it arrived (the notifier's receiving end in tests)."""

    def __init__(self) -> None:
        self.got: list[tuple[float, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.got.append((time.time(), body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *a) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/alerts"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def events(self, kind: str) -> list[tuple[float, dict]]:
        return [(t, b["event"]) for t, b in self.got if b["event"]["kind"] == kind]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class SimRoot(SysfsRoot):
    """The simulated host as a `SysfsRoot`, in process: every read and write goes through
    the simulator's kernel-like file operations (`SimHost.read/write`, real errno), no
    FUSE mount. `files_root` is where paths opened with os.open (the kernel log
    `dev/kmsg`) resolve: a real folder the test fills."""

    def __init__(self, host, files_root: str = "/") -> None:
        super().__init__(files_root)
        self.host = host

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self.host.read("/" + rel.lstrip("/"))
        except OSError as e:
            raise SysfsError(rel, e.errno or errno_mod.EIO) from None

    def held(self, rel: str):
        """A held attribute reads anew each time, as kernfs renders one (hw/sysfs.HeldAttribute)."""
        return SimpleNamespace(read=lambda: self.read_bytes(rel), close=lambda: None, rel=rel)

    def write_text(self, rel: str, value: str) -> None:
        try:
            self.host.write("/" + rel.lstrip("/"), value.encode())
        except OSError as e:
            raise SysfsError(rel, e.errno or errno_mod.EIO, "write") from None

    def exists(self, rel: str) -> bool:
        try:
            self.host.getattr("/" + rel.lstrip("/"), follow=True)
            return True
        except OSError:
            return False

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(self.host.readdir("/" + rel.lstrip("/")))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise SysfsError(rel, e.errno or errno_mod.EIO, "list") from None


def sim_extra(host, overlay=None) -> dict:
    """The files a test mount adds beside the sysfs tree: `overlay` (path -> bytes, changeable
    while mounted) and `/dev/kmsg` as a plain file of the simulated kernel log."""
    extra = dict(overlay or {})
    extra.setdefault("/dev/kmsg", lambda: "".join(host.kmsg_lines()).encode())
    return extra
