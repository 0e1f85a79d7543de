"""The outcome of each SIGHUP reload, written where `gpuguard reload` (the unit's
ExecReload=) waits for it, so `systemctl reload gpuguard` returns only once the new config
is in effect — or fails when it was refused.

Why a file: `ExecReload=/bin/kill -HUP $MAINPID` returns at once and systemd finishes the
reload job before the daemon has read the file (seen once in three);
systemd.service(5) asks for a reload command that waits. `Type=notify-reload` would do it
with RELOADING=1/READY=1 alone, but needs systemd ≥ 253 (Debian 12 has 252).

The record is `$RUNTIME_DIRECTORY/reload.json` (/run/gpuguard under the unit):
{"pid": main PID, "generation": reloads since start, "ok": bool, "time": epoch}. Written
atomically (rename), so a reader never sees half a record. Outside systemd (no
RUNTIME_DIRECTORY) nothing is written.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("gpuguard.reload")

FILE_NAME = "reload.json"


def default_path() -> Path | None:
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return Path(runtime) / FILE_NAME if runtime else None


class ReloadMarker:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else default_path()
        self.generation = 0

    def record(self, ok: bool) -> None:
        self.generation += 1
        if self.path is None:
            return
        doc = {"pid": os.getpid(), "generation": self.generation, "ok": bool(ok), "time": time.time()}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(doc) + "\n")
            os.replace(tmp, self.path)
        except OSError as e:
            # the reload itself happened; only its waiter will time out (and say so)
            log.error("cannot write the reload record path=%s error=%s", self.path, e.strerror)


def read(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
