"""SIGHUP, section by section, in-process: a Daemon built on a written simulated tree,
`Daemon.reload()` with one change, and the running object that change is for is read
back. Every key config/reload.py calls live must have changed in the running daemon
(issue 11: the log said "applied" for `kernel:` and `engines:` changes that were
ignored; later `recorder.max_bytes` and the safe-mode settings the same way); every key
it names as needing a restart must still run as it was, and be named in the
`config_reloaded` event. The FUSE/real-process version of a few of these is in
test_stop_and_reload.py."""
from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any, Callable

import pytest

from gpuguard.config import load_config
from gpuguard.daemon import Daemon
from gpuguard.sim.host import SimHost
from gpuguard.control.auth import TokenStore
from gpuguard.sim.tree import write_tree

R9700_A = "0000:05:00.0"
TOKEN = "t" * 40


def base_yaml(tmp: Path, engines: bool = True) -> str:
    return f"""
sysfs_root: {tmp / 'root'}
state_dir: {tmp / 'state'}
listen: {{address: 127.0.0.1, port: 0}}
poll: {{interval_seconds: 1.0, timeout_seconds: 2.0, discover_seconds: 5.0, pcie_interval_seconds: 60, lost_after_seconds: 10}}
logging: {{level: info}}
recorder: {{path: {tmp / 'state' / 'flight.sqlite'}, keep_seconds: 3600, max_bytes: 50000000}}
kernel: {{kmsg_path: {tmp / 'kmsg'}, udev: false, allow_userspace: false, action_debounce_seconds: 30}}
api: {{token_file: {tmp / 'tokens-a.yaml'}, open_reads: false, max_body_bytes: 65536}}
webhooks: [{{url: "http://127.0.0.1:9/a"}}]
profiles:
  psu-safe: {{power_cap_w: 210}}
  psu-low: {{power_cap_w: 200}}
apply: {{retries: 2, backoff_seconds: 0.5, timeout_seconds: 20, safe_mode_window_seconds: 300, safe_mode_after_crashes: 2,
        wait_for_gpus: 0, wait_timeout_seconds: 60}}
gpus:
  - {{name: r9700-a, match: {{bdf: "{R9700_A}"}}, profile: psu-safe}}
power: {{psu_watts: 1600}}
""" + ("""engines:
  - {name: qwen, kind: vllm, url: "http://127.0.0.1:9", process: {cmdline: 'no-such-engine-xyz'}, gpus: [r9700-a],
     stall_after: 30}
""" if engines else "")


def rules_file(tmp: Path) -> str:
    p = tmp / "rules.yaml"
    p.write_text("rules:\n  - {kind: my_fault, severity: alert, type: event, pattern: 'my special fault'}\n")
    return str(p)


Get = Callable[[Daemon], Any]
# (what changes: text replaced in the base config, running value before → after)
LIVE: dict[str, tuple[tuple[str, str], Get, Any, Any]] = {
    "kernel.policy": (("action_debounce_seconds: 30}", "action_debounce_seconds: 30, policy: {gpu_hang: []}}"),
                      lambda d: d.kernel_router.policy.get("gpu_hang"), ("alert", "kill_engines"), ()),
    "kernel.allow_userspace": (("allow_userspace: false", "allow_userspace: true"),
                               lambda d: d.kmsg_reader.allow_userspace, False, True),
    "kernel.action_debounce_seconds": (("action_debounce_seconds: 30", "action_debounce_seconds: 7"),
                                       lambda d: (d.kernel_router.debounce_s, d.lifecycle.debounce_s), (30, 30), (7, 7)),
    "kernel.rules_file": (("udev: false,", "udev: false, rules_file: {rules},"),
                          lambda d: "my_fault" in {r.kind for r in d.kernel_router.rules.rules}, False, True),
    "recorder.keep_seconds": (("keep_seconds: 3600", "keep_seconds: 600"), lambda d: d.recorder.keep_seconds, 3600, 600),
    "recorder.max_bytes": (("max_bytes: 50000000", "max_bytes: 2000000"), lambda d: d.recorder.max_bytes,
                           50_000_000, 2_000_000),
    "webhooks": (('url: "http://127.0.0.1:9/a"', 'url: "http://127.0.0.1:9/b"'),
                 lambda d: [w.url for w in d.webhooks._configs], ["http://127.0.0.1:9/a"], ["http://127.0.0.1:9/b"]),
    "api.open_reads": (("open_reads: false", "open_reads: true"), lambda d: d.app.state.policy.open_reads, False, True),
    "api.max_body_bytes": (("max_body_bytes: 65536", "max_body_bytes: 4096"), lambda d: d.app.state.max_body_bytes,
                           65536, 4096),
    "api.token_file": (("tokens-a.yaml", "tokens-b.yaml"), lambda d: d.app.state.tokens.names, ["alice"], ["bob"]),
    "apply.retries": (("retries: 2", "retries: 5"), lambda d: d.profiles.applier.retries, 2, 5),
    "apply.backoff_seconds": (("backoff_seconds: 0.5", "backoff_seconds: 0.1"), lambda d: d.profiles.applier.backoff,
                              0.5, 0.1),
    "apply.timeout_seconds": (("timeout_seconds: 20", "timeout_seconds: 3"),
                              lambda d: d.profiles.cfg.apply.timeout_seconds, 20, 3),
    "apply.safe_mode_window_seconds": (("safe_mode_window_seconds: 300", "safe_mode_window_seconds: 90"),
                                       lambda d: d.profiles.guard.window, 300, 90),
    "gpus": (("profile: psu-safe}", "profile: psu-low}"),
             lambda d: (d.gpus.get(R9700_A).profile, d.gpus.get(R9700_A).profile_state), ("psu-safe", "pending"),
             ("psu-low", "pending")),
    "profiles": (("psu-safe: {power_cap_w: 210}", "psu-safe: {power_cap_w: 190}"),
                 lambda d: d.profiles.cfg.profiles["psu-safe"].power_cap_w, 210, 190),
    "logging.level": (("level: info", "level: debug"), lambda d: logging.getLogger().level, logging.INFO, logging.DEBUG),
    "poll.interval_seconds": (("interval_seconds: 1.0", "interval_seconds: 0.5"),
                              lambda d: (d.poller.interval, d.hub.poll_budget_seconds), (1.0, 4.0), (0.5, 3.5)),
    "poll.timeout_seconds": (("timeout_seconds: 2.0", "timeout_seconds: 1.0"), lambda d: d.poller.timeout, 2.0, 1.0),
    "poll.discover_seconds": (("discover_seconds: 5.0", "discover_seconds: 2.0"), lambda d: d.poller.discover_every,
                              5.0, 2.0),
    "poll.pcie_interval_seconds": (("pcie_interval_seconds: 60", "pcie_interval_seconds: 30"), lambda d: d.pcie.interval,
                                   60, 30),
    "poll.lost_after_seconds": (("lost_after_seconds: 10", "lost_after_seconds: 4"), lambda d: d.gpus.lost_after_seconds,
                                10, 4),
    "engines": (("stall_after: 30", "stall_after: 12"), lambda d: d.engines._engines["qwen"].cfg.stall_after, 30, 12),
    "power.psu_watts": (("psu_watts: 1600", "psu_watts: 1200"), lambda d: d.power.budget.psu_w, 1600, 1200),
}

# keys that need a restart: (change, running value that must stay, the name the reload gives)
RESTART: dict[str, tuple[tuple[str, str], Get]] = {
    "listen.port": (("port: 0}", "port: 1}"), lambda d: d.config.listen.port),
    "sysfs_root": (("/root\n", "/elsewhere\n"), lambda d: (d.config.sysfs_root, d.root.path("/"))),
    "state_dir": (("state_dir: {tmp}/state\n", "state_dir: {tmp}/other\n"), lambda d: d.config.state_dir),
    "recorder.path": (("flight.sqlite", "other.sqlite"), lambda d: (d.config.recorder.path, d.recorder.path)),
    "kernel.kmsg_path": (("/kmsg,", "/kmsg2,"), lambda d: (d.config.kernel.kmsg_path, d.kmsg_reader.path)),
    "api.unix_socket": (("max_body_bytes: 65536}", "max_body_bytes: 65536, unix_socket: {tmp}/api.sock}"),
                        lambda d: d.config.api.unix_socket),
    # consulted once, at start: changing them while running changes nothing until then
    "apply.safe_mode_after_crashes": (("safe_mode_after_crashes: 2", "safe_mode_after_crashes: 5"),
                                      lambda d: (d.config.apply.safe_mode_after_crashes, d.profiles.guard.threshold)),
    "apply.wait_for_gpus": (("wait_for_gpus: 0", "wait_for_gpus: 1"), lambda d: d.config.apply.wait_for_gpus),
    "apply.wait_timeout_seconds": (("wait_timeout_seconds: 60", "wait_timeout_seconds: 5"),
                                   lambda d: d.config.apply.wait_timeout_seconds),
}


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    write_tree(SimHost.incident(), str(tmp_path / "root"))
    (tmp_path / "kmsg").write_text("")
    for name, who in (("a", "alice"), ("b", "bob")):
        p = tmp_path / f"tokens-{name}.yaml"
        p.write_text(f"{who}: {TOKEN}\n")
        os.chmod(p, 0o600)
    level = logging.getLogger().level
    yield tmp_path
    logging.getLogger().setLevel(level)


def run_reload(tmp: Path, text: str, new_text: str, get: Get) -> tuple[Any, Any, bool, dict]:
    cfg_file = tmp / "gpuguard.yaml"
    cfg_file.write_text(text)

    async def main():
        logging.getLogger().setLevel(logging.INFO)  # what logsetup does from logging.level at start
        d = Daemon(load_config(str(cfg_file)), config_path=str(cfg_file))
        d.app.state.tokens = TokenStore.load(d.config.api.token_file)  # as the start does
        events = []
        d.hub.on_event(lambda e: events.append(e) if e.kind == "config_reloaded" else None)
        try:
            await d.poller.poll_once()  # discovery: the GPU states exist
            d.start_kernel_sources()
            before = get(d)
            cfg_file.write_text(new_text)
            ok = d.reload()
            return before, get(d), ok, events[-1].fields if events else {}
        finally:
            for t in d.tasks:
                t.cancel()
            await asyncio.gather(*d.tasks, return_exceptions=True)
            d.poller.close()
            d.power.close()
            if d.recorder is not None:
                d.recorder.close()
            if d.engines is not None:
                await d.engines.aclose()

    return asyncio.run(main())


@pytest.mark.parametrize("key", sorted(LIVE))
def test_a_key_reloaded_live_changes_the_running_daemon(tree, key):
    (old, new), get, want_before, want_after = LIVE[key]
    text = base_yaml(tree)
    new = new.replace("{rules}", rules_file(tree))
    assert text.count(old) == 1, f"the base config has no single {old!r}"
    before, after, ok, fields = run_reload(tree, text, text.replace(old, new), get)
    assert ok and before == want_before, (before, want_before)
    assert after == want_after, f"reload said {key} was applied, the running daemon has {after!r}"
    assert key in fields["applied"] and not fields["needs_restart"], fields


@pytest.mark.parametrize("key", sorted(RESTART))
def test_a_key_that_needs_a_restart_is_named_and_kept_as_running(tree, key):
    (old, new), get = RESTART[key]
    old, new = old.replace("{tmp}", str(tree)), new.replace("{tmp}", str(tree))
    text = base_yaml(tree)
    assert text.count(old) == 1, f"the base config has no single {old!r}"
    before, after, ok, fields = run_reload(tree, text, text.replace(old, new), get)
    assert ok and after == before, f"{key} needs a restart, yet the running daemon has {after!r}, not {before!r}"
    assert fields["needs_restart"] == [key] and key not in fields["applied"], fields


def test_the_first_engine_of_a_daemon_started_without_any_needs_a_restart(tree):
    text = base_yaml(tree, engines=False)
    before, after, ok, fields = run_reload(tree, text, base_yaml(tree, engines=True), lambda d: d.engines)
    assert ok and before is None and after is None
    assert fields["needs_restart"] == ["engines"] and "engines" not in fields["applied"]
