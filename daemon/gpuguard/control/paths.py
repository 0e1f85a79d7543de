"""The action routes' paths (POST under `/v1/`), known without loading the framework
that serves them: the HTTP surface (sinks/api.py) sends a request for one of these to
the control app (control/routes.py, FastAPI, built on the first such request) and
everything else to the read routes. A daemon that is only read and scraped never
imports FastAPI (issue 15: it is 11 MiB of a 48 MiB budget)."""
from __future__ import annotations

import re

APPLY = "/v1/gpus/{gpu}/apply"
CONFIRM = "/v1/gpus/{gpu}/confirm"
RESET = "/v1/gpus/{gpu}/reset"
KILL = "/v1/engines/{engine}/kill"
RESTART = "/v1/engines/{engine}/restart"
QUARANTINE = "/v1/caches/{cache}/quarantine"
ACTION_PATHS = (APPLY, CONFIRM, RESET, KILL, RESTART, QUARANTINE)
# FastAPI documents the control API here (served by the control app)
OPENAPI = "/openapi.json"

# a path parameter matches one segment, as the router's own `{name}` does
_ACTION_RE = re.compile("|".join("^" + re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(p)) + "$"
                                 for p in (*ACTION_PATHS, OPENAPI)))


def is_control_path(path: str) -> bool:
    """True for a path the control app answers (whatever the method: it says 405)."""
    return _ACTION_RE.match(path) is not None
