"""The api:/webhooks: config sections (errors name key and line) and the audit log
(append-only JSON lines, private, never blocking)."""
from __future__ import annotations

import json
import os
import stat

import pytest

from gpuguard.config import ConfigError, parse_config
from gpuguard.state.audit import AuditLog


def test_service_sections_hang_off_the_root_config():
    c = parse_config("api:\n  token_file: /etc/gpuguard/api-tokens\n  open_reads: true\n"
                     "webhooks:\n  - url: https://hooks.example.net/x\n    retries: 0\n")
    assert c.api.token_file == "/etc/gpuguard/api-tokens" and c.api.open_reads
    assert c.webhooks[0].retries == 0 and c.webhooks[0].timeout_seconds == 5.0
    d = parse_config("")
    assert d.api.token_file is None and not d.api.open_reads and d.webhooks == []


@pytest.mark.parametrize(
    "text, where",
    [
        ("api:\n  token_file: tokens.yaml\n", "api.token_file (line 2)"),
        ("api:\n  max_body_bytes: 10\n", "api.max_body_bytes (line 2)"),
        ("api:\n  open_read: true\n", "api.open_read (line 2)"),
        ("webhooks:\n  - url: ftp://x\n", "webhooks[0].url (line 2)"),
        ("webhooks:\n  - url: https://x\n  - url: https://y\n    retries: 99\n", "webhooks[1].retries (line 4)"),
    ],
)
def test_bad_service_config_names_key_and_line(text, where):
    with pytest.raises(ConfigError) as e:
        parse_config(text)
    assert where in str(e.value)


def test_audit_log_appends_private_json_lines(tmp_path):
    log = AuditLog.in_state_dir(str(tmp_path / "state"))
    log.record("engine.kill", "api:alice", "stalled 12 s", target="vllm-a", evidence={"pids": (1, 2)})
    log.record("gpu.apply", "policy:psu", "boot", target="gpu0", result="refused: out of range")
    lines = (tmp_path / "state" / "audit.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["what"] == "engine.kill" and first["who"] == "api:alice" and first["why"] == "stalled 12 s"
    assert first["evidence"] == {"pids": [1, 2]} and first["time"].endswith("+00:00") and first["result"] == "ok"
    assert [r["target"] for r in log] == ["vllm-a", "gpu0"]
    assert stat.S_IMODE(os.stat(log.path).st_mode) == 0o600


def test_audit_log_never_rewrites_what_is_there(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl")
    log.path.write_text('{"what": "earlier"}\n')
    log.record("cache.quarantine", "api:ci", "zero-byte files", target="vllm-compile")
    assert [r["what"] for r in log] == ["earlier", "cache.quarantine"]


def test_audit_log_on_a_fifo_does_not_block_and_logs_the_record(tmp_path, caplog):
    path = tmp_path / "audit.jsonl"
    os.mkfifo(path)  # nobody reads it: a blocking open would hang the event loop
    rec = AuditLog(path).record("engine.kill", "api:alice", "why", target="vllm-a")
    assert rec["who"] == "api:alice"
    assert any("audit record not written" in r.getMessage() and "vllm-a" in r.getMessage() for r in caplog.records)
