"""The audit log: one JSON line per action that kills a process or writes hardware (or
was asked to), with what, on which target, who asked (API token name, policy, CLI), why,
the evidence, the result and the time (DESIGN.md safety rules).

Append-only: the file is opened with O_APPEND and each record is one `write()` of one
line, so concurrent writers never interleave and nothing is ever rewritten. Each record
is fsynced: the evidence must survive the hard reboot that may follow (INCIDENTS §2).

Written by whatever acts — the engine watchdog's kills, profile applies, the control API —
so it sits with the daemon's state, below all of them. The profile applier speaks in flat
records (`{"action": "write", "who", "why", "gpu", "bdf", "file", "value", ...}`):
`profile_record` files them as `profile_<action>` with the rest as evidence, and
`profile_records` reads them back flat (tests, `gpuguard apply`). The engine watchdog
hands over typed `EngineAction` values carrying the action's real outcome, and
`engine_action` is the one place they become audit lines.
"""
from __future__ import annotations

import datetime as dt
import errno
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

log = logging.getLogger("gpuguard.audit")

AUDIT_FILE = "audit.jsonl"
# Space held on disk for the records that follow a change's "started" record (each write,
# its read back, the outcome): an apply of a few cards with retries writes ~25 KiB. The
# record written before a change tops this up first, so a change starts only with room
# for its whole trail; records that meet a full disk are written into it.
RESERVE_BYTES = 64 * 1024
# the fields of a flat profile record that are the audit record's own; the rest is evidence
_PROFILE_TOP = ("action", "who", "why", "gpu", "result")


Outcome = Literal["ok", "failed", "gone", "not gone"]


@dataclass(frozen=True)
class EngineAction(Mapping):
    """One action the engine watchdog took (kill, restart, quarantine) and what came of it:
    `outcome` is what happened, never assumed — "gone" / "not gone" for a kill, "ok" or
    "failed" (with the command's `returncode` where one ran) for the rest; `detail` says
    it in words. Reads as a mapping of its fields too (tests and tools read records so)."""

    what: str  # kill | restart | quarantine
    why: str
    who: str
    engine: str
    kind: str
    outcome: Outcome
    detail: str = ""
    returncode: int | None = None
    gpus: tuple[str, ...] = ()
    evidence: dict = field(default_factory=dict)
    result: dict = field(default_factory=dict)  # the action's own record (KillResult, the command, ...)
    time: float = 0.0  # when the watchdog decided it (the record's own time is when it is written)

    @property
    def result_text(self) -> str:
        """The audit record's `result`: "failed: restart command exited 1", "gone", ..."""
        return f"{self.outcome}: {self.detail}" if self.detail else self.outcome

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.__dataclass_fields__)

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class AuditUnavailable(Exception):
    """The audit record could not be written (disk full, read-only, missing folder): the
    action it was for must not happen (a change went through on a full disk)."""


def jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [jsonable(x) for x in v]
    if hasattr(v, "to_dict"):
        return jsonable(v.to_dict())
    if hasattr(v, "items"):
        return {str(k): jsonable(x) for k, x in v.items()}
    return repr(v)


class AuditLog:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        # told about every failed / successful write (state/state_dir.StateDir: /healthz,
        # STATUS= and the alert say the folder is unusable)
        self.health: Any = None

    @classmethod
    def in_state_dir(cls, state_dir: str) -> "AuditLog":
        return cls(Path(state_dir) / AUDIT_FILE)

    def record(
        self,
        what: str,
        who: str,
        why: str,
        *,
        target: str | None = None,
        evidence: Any = None,
        result: str = "ok",
        when: float | None = None,
        required: bool = False,
    ) -> dict[str, Any]:
        """Append one record and return it. A failure to write is logged as an error with
        the whole record (so the journal still has it); with `required` (the record written
        *before* an action) it is also raised as AuditUnavailable, and the caller must not act."""
        t = time.time() if when is None else when
        rec = {
            "time": dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds"),
            "unix_time": t,
            "what": what,
            "target": target,
            "who": who,
            "why": why,
            "result": result,
            "evidence": jsonable(evidence),
        }
        line = (json.dumps(rec, sort_keys=True, ensure_ascii=True) + "\n").encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if required:
                self._hold_reserve()
            self._append(line)
        except OSError as e:
            log.error("audit record not written path=%s error=%s record=%s", self.path, e.strerror, line.decode().strip())
            if self.health is not None:
                self.health.failed(str(self.path), e)
            if required:
                why = (f"no room for the change's audit trail ({RESERVE_BYTES // 1024} KiB held in {self._reserve}): "
                       if getattr(e, "filename", None) == str(self._reserve) else "")
                raise AuditUnavailable(f"audit record not written to {self.path}: {why}{e.strerror or e}") from None
            return rec
        if self.health is not None:
            self.health.succeeded()
        return rec

    @property
    def _reserve(self) -> Path:
        return self.path.with_name(self.path.name + ".reserve")

    def _hold_reserve(self) -> None:
        """Top the reserve file up to RESERVE_BYTES of allocated blocks (not a hole);
        OSError naming the reserve file when the disk cannot give them."""
        fd = os.open(self._reserve, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        try:
            if os.fstat(fd).st_blocks * 512 < RESERVE_BYTES:
                try:
                    os.posix_fallocate(fd, 0, RESERVE_BYTES)
                except OSError as e:
                    raise OSError(e.errno, e.strerror, str(self._reserve)) from None
        finally:
            os.close(fd)

    def _release(self, need: int) -> bool:
        """Give `need` bytes (and a page more) of the reserve back to the disk; False when
        nothing is left to give."""
        try:
            fd = os.open(self._reserve, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return False
            os.ftruncate(fd, max(0, size - (need // 4096 + 2) * 4096))
            return True
        finally:
            os.close(fd)

    def _append(self, line: bytes) -> None:
        """One whole line or an OSError: a write cut short by a full disk goes on from the
        reserve; when even that is spent the cut line is taken back, so the log never
        holds half a record."""
        # O_NONBLOCK: a FIFO planted at this path must not wedge the event loop.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        try:
            rest = memoryview(line)
            while rest:
                try:
                    rest = rest[os.write(fd, rest):]
                except OSError as e:
                    if e.errno == errno.ENOSPC and self._release(len(rest)):
                        continue
                    written = len(line) - len(rest)
                    if written and os.fstat(fd).st_mode & 0o170000 == 0o100000:
                        # O_APPEND: our bytes are the file's last ones
                        os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_END) - written)
                    raise
            os.fsync(fd)
        finally:
            os.close(fd)

    def profile_record(self, record: dict[str, Any]) -> None:
        """One flat record of the profile applier (the `audit` callable it is given)."""
        self.record(
            f"profile_{record.get('action', '?')}",
            str(record.get("who", "?")),
            str(record.get("why", "")),
            target=record.get("gpu"),
            evidence={k: v for k, v in record.items() if k not in _PROFILE_TOP},
            result=str(record.get("result", "ok")),
        )

    def engine_action(self, action: EngineAction) -> dict[str, Any]:
        """File one engine action as `engine.<what>` with its outcome as the result."""
        return self.record(
            f"engine.{action.what}", action.who, action.why, target=action.engine,
            evidence={"evidence": action.evidence, "gpus": list(action.gpus), "kind": action.kind,
                      "result": action.result, "returncode": action.returncode},
            result=action.result_text,
        )

    def profile_started(self, gpu: str, profile: str, who: str, why: str) -> None:
        """The record written before a card is touched; raises AuditUnavailable when it
        cannot be written, and then nothing is applied."""
        self.record("profile_apply", who, why, target=gpu, evidence={"profile": profile}, result="started",
                    required=True)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Read the records back (tests, `gpuguard audit`-style tools)."""
        try:
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        yield json.loads(line)
        except FileNotFoundError:
            return


def profile_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The profile records of the audit log at `path`, flat again (other actions skipped)."""
    return [
        {
            **(rec.get("evidence") or {}),
            "action": rec["what"][len("profile_"):],
            "who": rec["who"], "why": rec["why"], "gpu": rec.get("target"),
            "result": rec.get("result"), "time": rec.get("unix_time"),
        }
        for rec in AuditLog(path)
        if str(rec.get("what", "")).startswith("profile_")
    ]
