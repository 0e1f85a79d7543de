"""The INCIDENTS §3 replay on the FUSE-mounted simulated host, in-process daemon: two XTX
under the same full load, one given the forgotten 1500 MHz limit through the control API's
apply → gpuguard says the two cards disagree, naming both and the limit. The confirm-window
revert puts the card back → the finding clears within one poll (issue 14: a stale
"above its 1500 MHz limit" outlived the revert)."""
from __future__ import annotations

import asyncio

from gpuguard.config import load_config
from gpuguard.daemon import Daemon
from gpuguard.control.profile_actions import ProfileActions
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.fuse]  # registered in pyproject.toml


XTX = {"xtx-a": "0000:aa:00.0", "xtx-b": "0000:b0:00.0"}


def write_config(tmp_path, mount):
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text(f"""
sysfs_root: {mount}
state_dir: {tmp_path / 'state'}
recorder: {{enabled: false}}
listen: {{address: 127.0.0.1, port: 0}}
poll: {{interval_seconds: 0.3, discover_seconds: 0.5, pcie_interval_seconds: 600}}
profiles:
  xtx-2000: {{sclk_max_mhz: 2000, vddgfx_offset_mv: -100}}
  xtx-1500: {{sclk_max_mhz: 1500}}
apply: {{wait_for_gpus: 4, wait_timeout_seconds: 30, backoff_seconds: 0.05}}
gpus:
  - {{name: xtx-a, match: {{bdf: "0000:aa:00.0"}}, profile: xtx-2000}}
  - {{name: xtx-b, match: {{bdf: "0000:b0:00.0"}}, profile: xtx-2000}}
""")
    return load_config(cfg)


def mismatches(d):
    return [x for x in d.profiles.ledger.finding_list() if x.kind == "card_mismatch"]


def test_incident_3_replay_card_against_card_then_revert_clears_within_one_poll(tmp_path, mount_sim, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    m = mount_sim()
    cfg = write_config(tmp_path, m.mountpoint)
    events = []

    async def main():
        d = Daemon(cfg)
        d.hub.on_event(events.append)
        task = asyncio.create_task(d.run())

        async def until(cond, what, timeout=60.0):
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while not cond():
                assert not task.done(), task
                assert loop.time() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.05)

        try:
            await until(lambda: getattr(d, "profiles", None) is not None and d.profiles.ready, "profiles applied")
            for bdf in XTX.values():
                m.host.set_load(bdf, 1.0)
            api = ProfileActions(d.profiles)
            saved = await api.snapshot_state("xtx-b")  # what the confirm window keeps
            await api.apply_profile("xtx-b", "xtx-1500", "test-token")
            await until(lambda: mismatches(d), "the card-vs-card finding")
            await until(lambda: any(e.kind == "clock_card_mismatch" for e in events), "its event (debounced: 2 polls)")
            f = mismatches(d)[0]
            assert (f.gpu, f.peer, f.profile) == ("xtx-b", "xtx-a", "xtx-1500")
            assert f.observed_mhz < 1300 and f.reference_mhz > 1700  # §3: ~1233 vs ~1800 MHz
            assert "profile xtx-1500 on xtx-b limits SCLK to 1500 MHz" in f.message
            view = d.hub.view("profiles")
            assert any("xtx-b and xtx-a" in msg and "disagree" in msg for msg in view["findings"])
            scrape = d.metrics.render().decode()
            assert 'gpuguard_gpu_clock_disagreement{gpu="xtx-b",peer="xtx-a"} 1.0' in scrape
            assert 'gpuguard_profile_effective_finding{gpu="xtx-b",kind="card_mismatch",profile="xtx-1500"} 1.0' in scrape
            # The confirm window expires: revert to what the card had.
            await api.restore_state("xtx-b", saved)
            assert mismatches(d) == []  # the cause went: the finding goes with it, at once
            c0 = d.poller.cycles
            await until(lambda: d.poller.cycles >= c0 + 2, "two more polls")
            assert mismatches(d) == [] and not [x for x in d.profiles.ledger.finding_list() if x.gpu == "xtx-b"]
            assert "gpuguard_gpu_clock_disagreement{" not in d.metrics.render().decode()
            kinds = [e.kind for e in events if e.kind.startswith("clock_card_mismatch")]
            assert kinds == ["clock_card_mismatch", "clock_card_mismatch_cleared"], kinds
        finally:
            d.request_stop()
            await asyncio.wait_for(task, 30)

    asyncio.run(main())
