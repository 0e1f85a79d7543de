"""Where the commands that talk to the running daemon (`status`, `engines`, `events`) find
it, one way for all of them: `--api URL`, else $GPUGUARD_API, else the config's `listen:`
(for a command given one), else http://127.0.0.1:9436. The demo takes a free port when
9436 is busy and prints the `export GPUGUARD_API=…` line that points every command at it.
(Not a command: modules starting with `_` are not registered.)"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

ENV = "GPUGUARD_API"
DEFAULT_API = "http://127.0.0.1:9436"


@dataclass(frozen=True)
class DaemonApi:
    base: str  # http://HOST:PORT, no trailing slash
    source: str  # where it came from, as a person would name it: "--api", "$GPUGUARD_API", ...

    @property
    def named(self) -> bool:
        """The user pointed at this daemon: not answering is an error, never a fallback."""
        return self.source in ("--api", f"${ENV}")

    def url(self, path: str) -> str:
        return self.base + path

    def describe(self) -> str:
        return f"{self.base} (from {self.source})"


def add_api_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api", default=None, metavar="URL",
                   help=f"the daemon's API base URL (default: ${ENV}, else {DEFAULT_API})")


def daemon_api(args: argparse.Namespace, listen: Any = None) -> DaemonApi:
    """The daemon this command line means; `listen` is the config's `listen:` section,
    for commands that read a config."""
    if getattr(args, "api", None):
        return DaemonApi(args.api.rstrip("/"), "--api")
    env = os.environ.get(ENV, "").strip()
    if env:
        return DaemonApi(env.rstrip("/"), f"${ENV}")
    if listen is not None:
        # a daemon listening on every address answers on loopback
        host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(listen.address, listen.address)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return DaemonApi(f"http://{host}:{listen.port}", "the config's listen:")
    return DaemonApi(DEFAULT_API, "the default")
