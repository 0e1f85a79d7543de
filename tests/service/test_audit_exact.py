"""The audit log's records, exactly: every key, the time in UTC to the millisecond, the
evidence made JSON whatever it holds, one appended line per record in a file only its
owner reads, and what happens when the record cannot be written (logged with the whole
record; raised when the action must not happen without it). bench/mutation.sh found
these unobserved."""
from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import dataclass
from types import MappingProxyType

import pytest

from gpuguard.state.audit import AUDIT_FILE, AuditLog, AuditUnavailable, jsonable, profile_records


class Health:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def failed(self, path, error) -> None:
        self.calls.append(("failed", path, error.errno))

    def succeeded(self) -> None:
        self.calls.append(("succeeded",))


@dataclass
class WithDict:
    x: int

    def to_dict(self):
        return {"x": self.x, "t": (1, 2)}


def test_a_record_exactly(tmp_path):
    log = AuditLog(tmp_path / "a" / "audit.jsonl")
    rec = log.record("kill_engine", "api:alice", "stalled 61 s", target="vllm", evidence={"pids": (4, 5)},
                     result="gone", when=1700000000.1234)
    assert rec == {"time": "2023-11-14T22:13:20.123+00:00", "unix_time": 1700000000.1234, "what": "kill_engine",
                   "target": "vllm", "who": "api:alice", "why": "stalled 61 s", "result": "gone",
                   "evidence": {"pids": [4, 5]}}
    lines = (tmp_path / "a" / "audit.jsonl").read_bytes().decode().splitlines()
    assert lines == [json.dumps(rec, sort_keys=True, ensure_ascii=True)]
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "audit.jsonl").st_mode) == 0o600
    assert list(log) == [rec]


def test_defaults_and_now(tmp_path):
    import time

    log = AuditLog(tmp_path / "audit.jsonl")
    t0 = time.time()
    rec = log.record("write", "policy", "why")
    assert (rec["target"], rec["result"], rec["evidence"]) == (None, "ok", None)
    assert t0 <= rec["unix_time"] <= time.time()


def test_records_append_one_line_each(tmp_path):
    log = AuditLog.in_state_dir(str(tmp_path))
    assert log.path == tmp_path / AUDIT_FILE
    log.record("a", "w", "x", when=1.0)
    AuditLog(tmp_path / AUDIT_FILE).record("b", "w", "y", when=2.0)  # a second writer appends
    with open(tmp_path / AUDIT_FILE, "a") as f:
        f.write("\n")
    assert [r["what"] for r in log] == ["a", "b"]


def test_non_ascii_is_escaped_in_the_file(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl")
    log.record("write", "api:zoë", "températures", when=0.0)
    assert b"\\u00eb" in (tmp_path / "audit.jsonl").read_bytes()


def test_reading_a_log_not_written_yet():
    assert list(AuditLog("/nonexistent/audit.jsonl")) == []


def test_jsonable():
    class Opaque:
        def __repr__(self) -> str:
            return "<opaque>"

    assert jsonable({1: (2, {3}), "m": MappingProxyType({"k": frozenset([4])}), "d": WithDict(7), "o": Opaque(),
                     "f": 1.5, "b": True, "n": None, "s": "x"}) == {
        "1": [2, [3]], "m": {"k": [4]}, "d": {"x": 7, "t": [1, 2]}, "o": "<opaque>", "f": 1.5, "b": True, "n": None,
        "s": "x"}


def test_health_is_told_of_every_write(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl")
    log.health = Health()
    log.record("a", "w", "x")
    assert log.health.calls == [("succeeded",)]


def test_a_record_that_cannot_be_written_is_logged_whole(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = AuditLog(blocker / "audit.jsonl")  # its folder is a file
    log.health = Health()
    with caplog.at_level(logging.ERROR, logger="gpuguard.audit"):
        rec = log.record("kill_engine", "policy", "stalled", target="vllm", when=0.0)
    assert rec["what"] == "kill_engine"
    assert log.health.calls == [("failed", str(blocker / "audit.jsonl"), 17)]
    line = json.dumps(rec, sort_keys=True, ensure_ascii=True)
    assert [r.getMessage() for r in caplog.records] == [
        f"audit record not written path={blocker / 'audit.jsonl'} error=File exists record={line}"]


def test_a_required_record_that_cannot_be_written_stops_the_action(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = AuditLog(blocker / "audit.jsonl")
    with pytest.raises(AuditUnavailable) as e:
        log.record("kill_engine", "policy", "stalled", required=True)
    assert str(e.value) == f"audit record not written to {blocker / 'audit.jsonl'}: File exists"


def _only(log: AuditLog) -> dict:
    (rec,) = list(log)
    return rec


def test_a_profile_record_is_filed_as_profile_action_with_the_rest_as_evidence(tmp_path):
    log = AuditLog(tmp_path / "a.jsonl")
    log.profile_record({"action": "write", "who": "api:alice", "why": "psu", "gpu": "r9700-a", "result": "retry",
                        "file": "power1_cap", "value": "210000000"})
    rec = _only(log)
    assert {k: rec[k] for k in ("what", "who", "why", "target", "result", "evidence")} == {
        "what": "profile_write", "who": "api:alice", "why": "psu", "target": "r9700-a", "result": "retry",
        "evidence": {"file": "power1_cap", "value": "210000000"}}
    assert profile_records(tmp_path / "a.jsonl") == [{"file": "power1_cap", "value": "210000000", "action": "write",
                                                     "who": "api:alice",
                                                     "why": "psu", "gpu": "r9700-a", "result": "retry",
                                                     "time": rec["unix_time"]}]


def test_a_profile_record_missing_its_keys_gets_the_defaults(tmp_path):
    log = AuditLog(tmp_path / "a.jsonl")
    log.profile_record({})
    rec = _only(log)
    assert {k: rec[k] for k in ("what", "who", "why", "target", "result", "evidence")} == {
        "what": "profile_?", "who": "?", "why": "", "target": None, "result": "ok", "evidence": {}}


def test_the_record_before_an_apply_is_required(tmp_path):
    log = AuditLog(tmp_path / "a.jsonl")
    log.profile_started("xtx-a", "xtx", "cli:root", "clock limit")
    rec = _only(log)
    assert {k: rec[k] for k in ("what", "who", "why", "target", "result", "evidence")} == {
        "what": "profile_apply", "who": "cli:root", "why": "clock limit", "target": "xtx-a", "result": "started",
        "evidence": {"profile": "xtx"}}
    (tmp_path / "file").write_text("")
    blocked = AuditLog(tmp_path / "file" / "a.jsonl")   # its folder is a file: cannot be written
    with pytest.raises(AuditUnavailable):
        blocked.profile_started("xtx-a", "xtx", "cli:root", "clock limit")


def test_the_log_makes_its_missing_folders(tmp_path):
    log = AuditLog(tmp_path / "state" / "sub" / "a.jsonl")
    log.record("x", "who", "why")
    assert [r["what"] for r in log] == ["x"]


def test_an_engine_action_is_filed_with_its_real_outcome(tmp_path):
    from gpuguard.state.audit import EngineAction

    log = AuditLog(tmp_path / "audit.jsonl")
    action = EngineAction(what="restart", why="heartbeat_flat", who="policy", engine="vllm-a", kind="vllm",
                          outcome="failed", detail="restart command exited 1", returncode=1, gpus=("xtx-0",),
                          evidence={"running": 2}, result={"command": {"argv": ["x"], "returncode": 1}},
                          time=1700000000.5)
    assert action["outcome"] == "failed" and dict(action)["returncode"] == 1 and len(action) == len(list(action))
    with pytest.raises(KeyError):
        action["nope"]
    import time

    t0 = time.time()
    rec = log.engine_action(action)
    assert t0 <= rec.pop("unix_time") <= time.time() and rec.pop("time").endswith("+00:00")
    assert rec == {"what": "engine.restart",
                   "target": "vllm-a", "who": "policy", "why": "heartbeat_flat",
                   "result": "failed: restart command exited 1",
                   "evidence": {"evidence": {"running": 2}, "gpus": ["xtx-0"], "kind": "vllm",
                                "result": {"command": {"argv": ["x"], "returncode": 1}}, "returncode": 1}}
    assert [{k: v for k, v in r.items() if "time" not in k} for r in log] == [rec]
    gone = EngineAction(what="kill", why="api", who="api:alice", engine="e", kind="vllm", outcome="gone", time=2.0)
    assert log.engine_action(gone)["result"] == "gone"
