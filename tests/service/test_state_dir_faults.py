"""Issue 12 items 1–3, against the daemon as a real process on the simulated host:

1. a full state folder (tiny tmpfs, filled): an apply answers 503, the card is not
   written, an alert reaches the webhook, /healthz says why;
2. a second daemon on the same state folder refuses to start and names the first's PID;
3. a read-only state folder (read-only tmpfs): the daemon starts, serves telemetry,
   refuses applies (503) and says so in /healthz and an alert.
"""
from __future__ import annotations

import json

import httpx
import pytest
from service.failsafe_harness import GuardProcess, XTX, can_mount, config_text, fill, od_file, sim_root, tmpfs
from support import WebhookReceiver

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


needs_mount = pytest.mark.skipif(can_mount() is not None, reason=str(can_mount()))


@pytest.fixture
def receiver():
    r = WebhookReceiver()
    yield r
    r.close()


def _apply(base: str, token: str) -> httpx.Response:
    return httpx.post(base + "/v1/gpus/xtx-0/apply", json={"profile": "quiet", "reason": "test"},
                      headers={"Authorization": f"Bearer {token}"}, timeout=30)


@needs_mount
def test_full_state_dir_refuses_the_apply_and_leaves_the_card_alone(tmp_path, receiver, make_token_file, tokens, wait):
    root = sim_root(tmp_path)
    od = od_file(root)
    before = od.read_bytes()
    token_file = make_token_file(tmp_path / "tokens")
    with tmpfs(tmp_path / "state", size="256k") as state:
        cfg = tmp_path / "gpuguard.yaml"
        cfg.write_text(config_text(state, tmp_path, token_file, receiver.url).replace("power_cap_w: 250", "sclk_max_mhz: 2000"))
        d = GuardProcess(cfg, root)
        try:
            base = d.find_base(wait)
            assert httpx.get(base + "/healthz", timeout=5).json()["state_dir"] == {"usable": True, "reason": None}
            fill(state)
            r = _apply(base, tokens["alice"])
            assert r.status_code == 503, r.text
            assert "audit record not written" in r.json()["detail"] and "nothing was changed" in r.json()["detail"]
            assert od.read_bytes() == before, "the card was written although its audit record was not"
            hits = wait(lambda: receiver.events("audit_unavailable"), timeout=10, what="the audit alert at the webhook")
            assert "gpu.apply on xtx-0 refused" in hits[0][1]["message"]
            health = httpx.get(base + "/healthz", timeout=5).json()
            assert health["state_dir"]["usable"] is False and "No space left" in health["state_dir"]["reason"]
            assert health["ok"] is True  # telemetry goes on
            wait(lambda: receiver.events("state_dir_unusable"), timeout=10, what="the state folder alert")
            # space again: the next apply goes through (the plain tree has no driver to read
            # the value back, so it ends 409 "unverified" — but it was written and audited)
            (state / "filler").unlink()
            r = _apply(base, tokens["alice"])
            assert r.status_code in (200, 409), r.text
            assert od.read_bytes() != before
            assert '"result": "started"' in (state / "audit.jsonl").read_text()
        finally:
            d.stop()


@needs_mount
def test_an_apply_goes_ahead_only_with_room_for_its_whole_audit_trail(tmp_path, make_token_file, tokens, wait):
    # Seen on a 3 MiB state folder, filled: applies answered 200 and wrote the card while
    # every record after "started" failed with ENOSPC — and the next apply went through too.
    root = sim_root(tmp_path)
    od = od_file(root)
    stock = od.read_bytes()  # a plain tree has no driver: the test puts the table back after each apply
    token_file = make_token_file(tmp_path / "tokens")
    with tmpfs(tmp_path / "state", size="256k") as state:
        cfg = tmp_path / "gpuguard.yaml"
        cfg.write_text(config_text(state, tmp_path, token_file).replace(
            "quiet: {power_cap_w: 250}", "quiet: {sclk_max_mhz: 2000}\n  fast: {sclk_max_mhz: 2100}"))
        d = GuardProcess(cfg, root)
        try:
            base = d.find_base(wait)

            def apply(profile: str, why: str) -> httpx.Response:
                return httpx.post(base + "/v1/gpus/xtx-0/apply", json={"profile": profile, "reason": why},
                                  headers={"Authorization": f"Bearer {tokens['alice']}"}, timeout=30)

            assert apply("quiet", "first").status_code in (200, 409)
            od.write_bytes(stock)
            fill(state)  # the folder fills between two changes
            # this change started with its reserve held: its whole trail is written
            r = apply("fast", "second")
            assert r.status_code in (200, 409), r.text
            after_second = od.read_bytes()
            assert b"2100" in after_second, r.text
            records = [json.loads(line) for line in (state / "audit.jsonl").read_text().splitlines()]
            second = [r for r in records if r["why"] == "second"]
            assert second[0]["result"] == "started" and second[-1]["what"] == "gpu.apply" \
                and second[-1]["result"] != "started", second
            assert any(r["what"] == "profile_write" and r["evidence"].get("value", "").endswith("2100")
                       for r in records), "the write itself was not audited"
            assert not d.log_has("audit record not written")
            od.write_bytes(stock)
            # the reserve is spent and cannot be had again: no change
            r = apply("quiet", "third")
            assert r.status_code == 503, r.text
            assert "audit trail" in r.json()["detail"] and "nothing was changed" in r.json()["detail"], r.text
            assert od.read_bytes() == stock, "the card was written without room for its audit trail"
        finally:
            d.stop()


def test_second_daemon_on_the_same_state_dir_refuses_and_names_the_pid(tmp_path, make_token_file, wait):
    root = sim_root(tmp_path)
    state = tmp_path / "state"
    cfg = tmp_path / "a.yaml"
    cfg.write_text(config_text(state, tmp_path, make_token_file(tmp_path / "tokens")))
    first = GuardProcess(cfg, root)
    try:
        first.find_base(wait)
        cfg_b = tmp_path / "b.yaml"  # another port, another recorder, the same state folder
        cfg_b.write_text(config_text(state, tmp_path / "b", None))
        (tmp_path / "b").mkdir()
        second = GuardProcess(cfg_b, root)
        assert second.proc.wait(60) == 1
        out = second.output()
        assert f"in use by PID {first.proc.pid}" in out and str(state) in out, out
        assert "Traceback" not in out
        assert not second.log_has("metrics at http://")
        assert first.proc.poll() is None  # the first one is untouched
    finally:
        first.stop()
    # the lock dies with its holder: the folder is free again
    third = GuardProcess(cfg, root)
    try:
        third.find_base(wait)
    finally:
        assert third.stop() == 0


def test_second_daemon_is_refused_even_when_the_first_was_killed_mid_write(tmp_path, make_token_file, wait):
    """SIGKILL leaves the pid file behind; the flock does not outlive the process."""
    import signal

    root = sim_root(tmp_path)
    state = tmp_path / "state"
    cfg = tmp_path / "a.yaml"
    cfg.write_text(config_text(state, tmp_path, make_token_file(tmp_path / "tokens")))
    first = GuardProcess(cfg, root)
    first.find_base(wait)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    assert (state / "gpuguard.pid").exists()
    again = GuardProcess(cfg, root)
    try:
        again.find_base(wait)
    finally:
        assert again.stop() == 0


@needs_mount
def test_read_only_state_dir_starts_serves_and_refuses_applies(tmp_path, receiver, make_token_file, tokens, wait,
                                                               notify_socket):
    root = sim_root(tmp_path)
    od = od_file(root)
    before = od.read_bytes()
    token_file = make_token_file(tmp_path / "tokens")
    with tmpfs(tmp_path / "state", readonly=True) as state:
        cfg = tmp_path / "gpuguard.yaml"
        # the profile is assigned: the start-up apply must be refused too, never crash
        cfg.write_text(config_text(state, tmp_path, token_file, receiver.url).replace(
            "match: {bdf: '0000:aa:00.0'}\n", "match: {bdf: '0000:aa:00.0'}\n    profile: quiet\n").replace(
            "power_cap_w: 250", "sclk_max_mhz: 2000"))
        d = GuardProcess(cfg, root, env={"NOTIFY_SOCKET": notify_socket.path})
        try:
            base = d.find_base(wait)
            _, ready = wait(lambda: notify_socket.with_line("READY=1"), what="READY=1")[0]
            assert any(l.startswith("STATUS=") and "STATE DIR UNUSABLE" in l for l in ready.splitlines()), ready
            health = httpx.get(base + "/healthz", timeout=5).json()
            assert health["ok"] is True
            assert health["state_dir"]["usable"] is False and "Read-only" in health["state_dir"]["reason"]
            assert httpx.get(base + "/v1/gpus/xtx-0", timeout=5).json()["bdf"] == XTX  # telemetry served
            assert "gpuguard_" in httpx.get(base + "/metrics", timeout=5).text
            status = httpx.get(base + "/v1/status", timeout=5).json()
            assert "STATE DIR UNUSABLE" in status["summary"]
            r = _apply(base, tokens["alice"])
            assert r.status_code == 503, r.text
            assert od.read_bytes() == before
            wait(lambda: receiver.events("state_dir_unusable"), timeout=10, what="the state folder alert")
            assert not d.log_has("Traceback")
        finally:
            rc = d.stop()
        assert rc == 0, d.output()
        assert "Traceback" not in d.output()


@needs_mount
def test_missing_state_dir_that_cannot_be_made_starts_and_says_why(tmp_path, make_token_file, tokens, wait):
    root = sim_root(tmp_path)
    with tmpfs(tmp_path / "ro", readonly=True) as ro:
        cfg = tmp_path / "gpuguard.yaml"
        cfg.write_text(config_text(ro / "state", tmp_path, make_token_file(tmp_path / "tokens")))
        d = GuardProcess(cfg, root)
        try:
            base = d.find_base(wait)
            health = httpx.get(base + "/healthz", timeout=5).json()
            assert health["ok"] is True and health["state_dir"]["usable"] is False
            assert f"state_dir {ro / 'state'} cannot be made: Read-only file system" == health["state_dir"]["reason"]
            assert _apply(base, tokens["alice"]).status_code == 503
        finally:
            assert d.stop() == 0
        assert "Traceback" not in d.output()


@needs_mount
def test_cli_apply_refuses_when_its_audit_record_cannot_be_written(tmp_path):
    import os
    import subprocess
    import sys

    from service.failsafe_harness import REPO

    root = sim_root(tmp_path)
    od = od_file(root)
    before = od.read_bytes()
    with tmpfs(tmp_path / "state", readonly=True) as state:
        cfg = tmp_path / "gpuguard.yaml"
        cfg.write_text(config_text(state, tmp_path, None).replace("power_cap_w: 250", "sclk_max_mhz: 2000"))
        r = subprocess.run([sys.executable, "-m", "gpuguard", "apply", "--config", str(cfg), "--sysfs-root", str(root),
                            "--profile", "quiet", "xtx-0"], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(REPO / "daemon")))
    assert r.returncode == 1, r.stderr
    assert "xtx-0: refused, nothing written: audit record not written" in r.stderr and "Traceback" not in r.stderr
    assert od.read_bytes() == before
