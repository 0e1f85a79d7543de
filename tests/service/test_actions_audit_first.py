"""The daemon as a real process, with a real engine process, a real cache folder and a card
on the plain simulated tree: a kill, restart, reset or quarantine asked through the API
never runs before its audit record is on disk (the audit log at a path that cannot be
written: each answers 503, and the engine lives, the cache stays, the card is untouched,
the restart command never ran); and the engine's own audit record carries the action's
real outcome (a restart command that exits 1 is "failed" with its exit code, not "ok")."""
from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from service.failsafe_harness import GuardProcess, XTX, config_text, sim_root
from support import STARTS

from engines.engines_harness import alive, free_port, sim_env, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


@pytest.fixture
def engine():
    """A simulated vLLM in its own session, and a pid file only its owner may write."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpuguard.sim.engines", "--kind", "vllm", "--port", str(port)],
                            env=sim_env(), start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)

    def answers() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(answers, STARTS, what="the simulated vLLM")
        yield proc, port
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait(5)


def _setup(tmp_path: Path, proc: subprocess.Popen, port: int, make_token_file) -> tuple[Path, Path, Path, Path]:
    """-> (config, cache folder, restart marker, state folder)"""
    pid_file = tmp_path / "vllm.pid"
    pid_file.write_text(f"{proc.pid}\n")
    os.chmod(pid_file, 0o644)
    cache = tmp_path / "cache" / "torch_compile_cache"
    cache.mkdir(parents=True)
    (cache / "entry.bin").write_bytes(b"\0" * 64)
    marker = tmp_path / "restart-ran"
    state = tmp_path / "state"
    user = pwd.getpwuid(os.geteuid()).pw_name
    engines = (
        "engines:\n"
        f"  - name: vllm-a\n    kind: vllm\n    url: http://127.0.0.1:{port}\n"
        f"    process: {{pid_file: {pid_file}, user: {user}}}\n"
        "    poll_interval: 0.25\n    stall_after: 600\n    action: alert\n"
        f"    restart_command: [sh, -c, 'touch {marker}; echo restart refused by the test >&2; exit 1']\n"
        f"    caches: [{{name: torch-compile, path: {cache}}}]\n"
    )
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text(config_text(state, tmp_path, make_token_file(tmp_path / "tokens"), extra=engines))
    return cfg, cache, marker, state


def _card_files(root: Path) -> dict[str, bytes]:
    dev = next(root.glob(f"sys/devices/**/{XTX}"))
    return {str(p): p.read_bytes() for p in sorted(dev.rglob("*")) if p.is_file() and not p.is_symlink()}


ACTIONS = {
    "kill": "/v1/engines/vllm-a/kill",
    "restart": "/v1/engines/vllm-a/restart",
    "reset": "/v1/gpus/xtx-0/reset",
    "quarantine": "/v1/caches/torch-compile/quarantine",
}


def test_no_action_runs_before_its_audit_record(tmp_path, engine, make_token_file, tokens, wait):
    proc, port = engine
    root = sim_root(tmp_path)
    cfg, cache, marker, state = _setup(tmp_path, proc, port, make_token_file)
    (state / "audit.jsonl").mkdir(parents=True)  # the audit log's path cannot be written
    card = _card_files(root)
    tree = [proc.pid] + [c.pid for c in __import__("psutil").Process(proc.pid).children(recursive=True)]
    d = GuardProcess(cfg, root)
    try:
        base = d.find_base(wait, timeout=STARTS)
        # the engine is watched (found through its pid file) before it is asked to die
        wait(lambda: httpx.get(base + "/v1/engines", timeout=5).json()[0].get("pid") == proc.pid, timeout=STARTS,
             what="the engine watched")
        answers = {}
        for action, path in ACTIONS.items():
            r = httpx.post(base + path, json={"reason": "test"}, headers={"Authorization": f"Bearer {tokens['alice']}"},
                           timeout=60)
            answers[action] = (r.status_code, r.json().get("detail"))
        assert {a: code for a, (code, _) in answers.items()} == dict.fromkeys(ACTIONS, 503), answers
        for action, (_, detail) in answers.items():
            assert "audit record not written" in detail and "nothing was changed" in detail, (action, detail)
        assert all(alive(p) for p in tree), "the engine was signalled although its kill was never audited"
        assert not marker.exists(), "the restart command ran although the restart was never audited"
        assert cache.is_dir() and (cache / "entry.bin").exists() and [p.name for p in cache.parent.iterdir()] == [
            "torch_compile_cache"], "the cache was renamed although the quarantine was never audited"
        assert _card_files(root) == card, "the card was written although its reset was never audited"
        assert not d.log_has("Traceback")
    finally:
        d.stop()


def test_a_failed_restart_is_audited_as_failed_with_its_exit_code(tmp_path, engine, make_token_file, tokens, wait):
    proc, port = engine
    root = sim_root(tmp_path)
    cfg, cache, marker, state = _setup(tmp_path, proc, port, make_token_file)
    d = GuardProcess(cfg, root)
    try:
        base = d.find_base(wait, timeout=STARTS)
        wait(lambda: httpx.get(base + "/v1/engines", timeout=5).json()[0].get("pid") == proc.pid, timeout=STARTS,
             what="the engine watched")
        r = httpx.post(base + ACTIONS["restart"], json={"reason": "test"},
                       headers={"Authorization": f"Bearer {tokens['alice']}"}, timeout=60)
        assert marker.exists()
        assert r.status_code == 409, r.text  # not "ok": the restart did not happen
        assert "restart command sh -c" in r.json()["detail"] and "exited 1" in r.json()["detail"], r.text
    finally:
        d.stop()
    records = [json.loads(line) for line in (state / "audit.jsonl").read_text().splitlines()]
    restarts = [(x["who"], x["result"]) for x in records if x["what"] == "engine.restart"]
    # the API's record before and after, and the watchdog's own record of what the command did
    assert restarts[0] == ("api:alice", "started")
    assert ("api:alice", "failed: restart command exited 1") in restarts, restarts
    engine_rec = next(x for x in records if x["what"] == "engine.restart" and x["result"].startswith("failed: restart"))
    assert engine_rec["evidence"]["result"]["command"]["returncode"] == 1
    assert "restart refused by the test" in engine_rec["evidence"]["result"]["command"]["output"]
    assert not [x for x in records if x["what"] == "engine.restart" and x["result"] == "ok"], restarts
