"""SIGHUP (config/reload.py): every changed key of every section is either applied live
or named as needing a restart and kept at its running value — never "applied" for what
was not (issue 11 item 6). The daemon test (tests/daemon/test_stop_and_reload.py) shows
the live ones taking effect in the running process."""
from __future__ import annotations

import pytest

from gpuguard.config.reload import LIVE_SECTIONS, plan_reload
from gpuguard.config.schema import Config

BASE = Config()

CHANGES = {
    # section: (change, expected live keys, expected restart keys)
    "poll": ({"poll": {"interval_seconds": 0.5}}, ["poll.interval_seconds"], []),
    "gpus": ({"gpus": [{"name": "x", "match": {"bdf": "0000:05:00.0"}}]}, ["gpus"], []),
    "logging": ({"logging": {"level": "debug"}}, ["logging.level"], []),
    "webhooks": ({"webhooks": [{"url": "http://127.0.0.1:1/a"}]}, ["webhooks"], []),
    "profiles": ({"profiles": {"p": {"power_cap_w": 200}}}, ["profiles"], []),
    "apply": ({"apply": {"retries": 5}}, ["apply.retries"], []),
    "apply-at-start": ({"apply": {"safe_mode_window_seconds": 60, "safe_mode_after_crashes": 4, "wait_for_gpus": 2}},
                       ["apply.safe_mode_window_seconds"], ["apply.safe_mode_after_crashes", "apply.wait_for_gpus"]),
    "power": ({"power": {"psu_watts": 1200, "sample_hz": 50}}, ["power.psu_watts", "power.sample_hz"], []),
    "recorder-size": ({"recorder": {"max_bytes": 10_000_000}}, ["recorder.max_bytes"], []),
    "kernel-live": ({"kernel": {"allow_userspace": True, "action_debounce_seconds": 5}},
                    ["kernel.allow_userspace", "kernel.action_debounce_seconds"], []),
    "kernel-restart": ({"kernel": {"kmsg_path": "/tmp/kmsg", "allow_userspace": True}},
                       ["kernel.allow_userspace"], ["kernel.kmsg_path"]),
    "api": ({"api": {"open_reads": True, "unix_socket": "/run/g.sock"}}, ["api.open_reads"], ["api.unix_socket"]),
    "recorder": ({"recorder": {"keep_seconds": 600, "path": "/var/lib/x.sqlite"}},
                 ["recorder.keep_seconds"], ["recorder.path"]),
    "listen": ({"listen": {"port": 9999}}, [], ["listen.port"]),
    "sysfs_root": ({"sysfs_root": "/elsewhere"}, [], ["sysfs_root"]),
    "state_dir": ({"state_dir": "/elsewhere"}, [], ["state_dir"]),
    "engines": ({"engines": [{"name": "e", "kind": "vllm", "url": "http://127.0.0.1:8000",
                              "process": {"cmdline": "vllm"}}]}, [], ["engines"]),
}


@pytest.mark.parametrize("case", sorted(CHANGES))
def test_each_section_is_applied_live_or_named_as_needing_restart(case):
    change, live, restart = CHANGES[case]
    new = Config.model_validate({**BASE.model_dump(), **{k: ({**BASE.model_dump()[k], **v} if isinstance(v, dict)
                                                            and isinstance(BASE.model_dump()[k], dict) else v)
                                                        for k, v in change.items()}})
    plan = plan_reload(BASE, new, LIVE_SECTIONS)
    assert sorted(plan.live) == sorted(live) and sorted(plan.restart) == sorted(restart)
    assert sorted(plan.changed) == sorted(live + restart)
    eff = plan.effective
    for key in restart:  # kept as running
        section, _, sub = key.partition(".")
        old, now = getattr(BASE, section), getattr(eff, section)
        assert (getattr(old, sub) == getattr(now, sub)) if sub else old == now
    for key in live:  # taken from the new file
        section, _, sub = key.partition(".")
        assert (getattr(getattr(eff, section), sub) == getattr(getattr(new, section), sub)) if sub else \
            getattr(eff, section) == getattr(new, section)


def test_engines_apply_live_once_the_watchdog_can_reconfigure():
    new = Config.model_validate({**BASE.model_dump(), "engines": [{"name": "e", "kind": "vllm", "url": "http://127.0.0.1:8000",
                                                                    "process": {"cmdline": "vllm"}}]})
    plan = plan_reload(BASE, new, LIVE_SECTIONS | {"engines"})
    assert plan.live == ["engines"] and plan.restart == []


def test_nothing_changed_says_so():
    plan = plan_reload(BASE, Config.model_validate(BASE.model_dump()), LIVE_SECTIONS)
    assert (plan.changed, plan.live, plan.restart) == ([], [], [])
