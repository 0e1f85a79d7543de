"""Who may call the control API: named bearer tokens from a file only root can read, and
the rule for when reads need one too.

The token file is a YAML mapping `name: token` (mode 0600 or 0400, owned by the daemon's
user). A group- or world-readable file is refused: a token anyone on the host can read
authenticates nobody. Tokens are compared with `hmac.compare_digest` against every
configured token (no early exit), so timing tells nothing about which one came close.
The token's *name* — never the token — is what the audit log records.
"""
from __future__ import annotations

import functools
import hmac
import ipaddress
import os
import re
import stat
from dataclasses import dataclass
from typing import Mapping

import yaml

TOKEN_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MIN_TOKEN_LENGTH = 16


class TokenFileError(Exception):
    """The token file cannot be used; the message names the file and what to do."""


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: `name` is the token's name (`alice`), `who` the audit form."""

    name: str

    @property
    def who(self) -> str:
        return f"api:{self.name}"


class TokenStore:
    """Named bearer tokens. Empty when no file is configured: every check fails."""

    def __init__(self, tokens: Mapping[str, str] | None = None, source: str | None = None) -> None:
        self._tokens = {n: t.encode() for n, t in (tokens or {}).items()}
        self.source = source

    @property
    def names(self) -> list[str]:
        return sorted(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def match(self, presented: str) -> str | None:
        """The name of the token equal to `presented`, else None. Constant time per token,
        and every token is compared whether or not an earlier one matched."""
        given = presented.encode("utf-8", "surrogateescape")
        found: str | None = None
        for name, token in self._tokens.items():
            if hmac.compare_digest(given, token):
                found = name
        return found

    @classmethod
    def load(cls, path: str | None) -> "TokenStore":
        if path is None:
            return cls({}, None)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:
            raise TokenFileError(f"api.token_file {path}: cannot open: {e.strerror}") from None
        try:
            st = os.fstat(fd)  # checked on the open file: no race with a chmod/rename
            if not stat.S_ISREG(st.st_mode):
                raise TokenFileError(f"api.token_file {path}: not a regular file")
            if st.st_mode & 0o077:
                raise TokenFileError(
                    f"api.token_file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users read or "
                    f"write the tokens; run: chmod 600 {path}"
                )
            if st.st_uid != os.geteuid():
                raise TokenFileError(
                    f"api.token_file {path}: owned by uid {st.st_uid}, not by the daemon's user "
                    f"(uid {os.geteuid()}); run: chown root: {path}"
                )
            with os.fdopen(os.dup(fd), "r", encoding="utf-8") as f:
                text = f.read()
        finally:
            os.close(fd)
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise TokenFileError(f"api.token_file {path}{where}: not valid YAML") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise TokenFileError(f"api.token_file {path}: must be a mapping of name: token lines")
        tokens: dict[str, str] = {}
        for name, token in data.items():
            name = str(name)
            if not TOKEN_NAME_RE.match(name):
                raise TokenFileError(f"api.token_file {path}: token name {name!r} must match {TOKEN_NAME_RE.pattern}")
            if not isinstance(token, str) or len(token) < MIN_TOKEN_LENGTH or any(c.isspace() for c in token):
                # the token value is never echoed: the error names only the entry
                raise TokenFileError(
                    f"api.token_file {path}: token {name!r} must be a string of at least "
                    f"{MIN_TOKEN_LENGTH} characters without spaces (e.g. from: openssl rand -hex 32)"
                )
            tokens[name] = token
        values = list(tokens.values())
        if len(set(values)) != len(values):
            raise TokenFileError(f"api.token_file {path}: two names share one token; the audit log could not tell them apart")
        return cls(tokens, path)


def is_loopback(address: str) -> bool:
    if address in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from the network


@dataclass(frozen=True)
class AccessPolicy:
    """Whether GET endpoints need a token: only when the daemon listens beyond loopback
    and `api.open_reads` is not set. Mutating endpoints always need one."""

    listen_address: str = "127.0.0.1"
    open_reads: bool = False

    @functools.cached_property
    def reads_need_token(self) -> bool:
        # asked on every request, /metrics included: the address is parsed once
        return not (self.open_reads or is_loopback(self.listen_address))


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def exposure_warnings(listen_address: str, open_reads: bool, token_file: str | None) -> list[str]:
    """What is reachable from the network without a token (reads were
    served to anyone without a word). Said at start and by `gpuguard doctor`."""
    if is_loopback(listen_address):
        return []
    out = []
    if open_reads:
        out.append(f"api: listening on {listen_address} with api.open_reads: true: /metrics, /v1/status, /v1/config "
                   "and /v1/events are readable by anyone who can reach this host, without a token")
    if token_file is None:
        out.append(f"api: listening on {listen_address} without api.token_file: reads need a token nobody has and "
                   "every change is refused; set api.token_file or listen on 127.0.0.1")
    return out
