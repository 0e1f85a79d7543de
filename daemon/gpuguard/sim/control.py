"""Control channel of a running simulated host: JSON lines over a UNIX socket.

Each request is one line `{"op": NAME, ...arguments}`; each answer one line
`{"ok": true, "result": ...}` or `{"ok": false, "error": "..."}`. Operations (SimHost
methods of the same name): set_load(bdf, level), set_vram(bdf, used_bytes), step(dt),
lose_gpu(bdf, err?), return_gpu(bdf, slot?) (its address back), add_late_gpu(bdf, after_s?), appear(bdf), renumber_hwmon(),
garbage(bdf, file, text), clear_garbage(bdf, file?), block(bdf, file), block_writes(bdf, file),
unblock(bdf, file?),
suspend(bdf, resume_error?), resume(bdf), reset_gpu(bdf, steps?),
ignore_first_write(bdf, kind?), transients(bdf, scale?), aer_error(bdf, name?, count?, severity?), plus
state() (JSON summary), gpus(), all_gpus(), kernel_log(since=0) (raw /dev/kmsg records), read(path)
(latin-1 text), write(path, data).

    from gpuguard.sim.control import send
    send("/run/sim.sock", "set_load", bdf="0000:05:00.0", level=1.0)

Shell: `echo '{"op":"reset_gpu","bdf":"0000:aa:00.0"}' | socat - UNIX:/run/sim.sock`
"""
from __future__ import annotations

import json
import os
import socket
import socketserver
import threading
from typing import Any, Callable

from .host import SimHost

HOST_OPS = ("set_load", "set_vram", "step", "lose_gpu", "return_gpu", "add_late_gpu", "appear", "renumber_hwmon",
            "garbage", "clear_garbage", "unblock", "suspend", "resume", "reset_gpu",
            "ignore_first_write", "transients", "aer_error", "state")


def default_socket() -> str:
    """Where `gpuguard demo` serves its control channel and `gpuguard sim` looks for it."""
    import tempfile

    return os.environ.get("GPUGUARD_SIM_SOCKET") or os.path.join(tempfile.gettempdir(), f"gpuguard-sim-{os.getuid()}.sock")


class ControlError(RuntimeError):
    pass


def handle(host: SimHost, req: dict, extra: dict[str, Callable[..., Any]] | None = None):
    op = req.pop("op", None)
    if extra and op in extra:  # what the program running the host adds (the demo: engine, kmsg, load)
        return extra[op](**req)
    if op in HOST_OPS:
        if "err" in req and isinstance(req["err"], str):
            import errno
            req["err"] = getattr(errno, req["err"])
        return getattr(host, op)(**req)
    if op in ("block", "block_writes"):
        getattr(host, op)(**req)
        return None
    if op == "gpus":
        return host.gpus
    if op == "all_gpus":  # lost and not-yet-appeared ones too
        return host.all_gpus
    if op == "kernel_log":
        return host.kmsg_lines(int(req.get("since", 0)))
    if op == "read":
        return host.read(req["path"]).decode("latin-1")
    if op == "write":
        return host.write(req["path"], req["data"].encode("latin-1"))
    known = HOST_OPS + ("block", "block_writes", "gpus", "all_gpus", "kernel_log", "read", "write") + tuple(extra or ())
    raise ControlError(f"unknown op {op!r}; known: {', '.join(known)}")


class ControlServer:
    """Serves the control channel for `host` on `path` in a background thread."""

    def __init__(self, host: SimHost, path: str, extra: dict[str, Callable[..., Any]] | None = None) -> None:
        self.host = host
        self.extra = extra if extra is not None else {}
        outer = self
        self.path = path
        if os.path.exists(path):
            os.unlink(path)
        host_ref = host

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for line in self.rfile:
                    if not line.strip():
                        continue
                    try:
                        req = json.loads(line)
                        if not isinstance(req, dict):
                            raise ControlError("request must be a JSON object")
                        out = {"ok": True, "result": handle(host_ref, req, outer.extra)}
                    except OSError as e:
                        out = {"ok": False, "error": f"{type(e).__name__}: {e}", "errno": e.errno}
                    except Exception as e:  # noqa: BLE001 - reported to the client, server stays up
                        out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                    self.wfile.write((json.dumps(out, default=str) + "\n").encode())
                    self.wfile.flush()

        self.server = socketserver.ThreadingUnixStreamServer(path, Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="sim-control", daemon=True)

    def start(self) -> "ControlServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if os.path.exists(self.path):
            os.unlink(self.path)


def send(socket_path: str, op: str, /, *, control_timeout: float = 10.0, **args):
    """One request; returns the result or raises ControlError with the server's message."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(control_timeout)
        s.connect(socket_path)
        s.sendall((json.dumps({"op": op, **args}) + "\n").encode())
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    reply = json.loads(buf)
    if not reply.get("ok"):
        raise ControlError(reply.get("error", "unknown error"))
    return reply.get("result")
