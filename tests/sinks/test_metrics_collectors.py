"""/metrics is one named collector per source: each scrape says per collector how long it took
and whether it answered; one that raises leaves out only its own families (the scrape still
answers 200); two collectors exporting one family name are refused at start, naming both."""
from __future__ import annotations

import asyncio
import logging

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.config import parse_config
from gpuguard.daemon import Daemon
from gpuguard.sim.host import SimHost
from gpuguard.sim.tree import write_tree
from gpuguard.sinks.api import build_app
from gpuguard.sinks.metrics import DURATION, SUCCESS, CollectorError, MetricsSink, same_objects
from gpuguard.state.hub import Hub

DAEMON_COLLECTORS = {"build", "gpu", "nvml", "poller", "kernel", "pcie", "webhooks", "gpu_conditions", "recorder", "engines",
                     "profiles", "power"}


def _gauge(name: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, "test family")
    g.add_metric([], value)
    return g


def incident_host_config(tmp_path, monkeypatch, rest: str):
    """A daemon's config on the seeded incident host written to tmp_path; `rest` adds keys."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    write_tree(SimHost.incident(seed=0), str(tmp_path / "root"))
    (tmp_path / "kmsg").write_text("")
    return parse_config(f"""
sysfs_root: {tmp_path / 'root'}
state_dir: {tmp_path / 'state'}
listen: {{address: 127.0.0.1, port: 0}}
""" + rest)


def test_each_collector_of_a_daemon_on_the_simulated_host_reports_duration_and_success(tmp_path, monkeypatch):
    cfg = incident_host_config(tmp_path, monkeypatch, f"""recorder: {{path: {tmp_path / 'state' / 'flight.sqlite'}}}
kernel: {{kmsg_path: {tmp_path / 'kmsg'}, udev: false, allow_userspace: false}}
webhooks: [{{url: "http://127.0.0.1:9/a"}}]
power: {{psu_watts: 1600}}
engines:
  - {{name: qwen, kind: vllm, url: "http://127.0.0.1:9", process: {{cmdline: 'no-such-engine-xyz'}}}}
""")

    async def main():
        d = Daemon(cfg)
        try:
            await d.poller.poll_once()
            await d.pcie.check_once()
            return d, d.metrics.registry.get_sample_value
        finally:
            d.poller.close()
            d.power.close()
            d.recorder.close()
            await d.engines.aclose()

    d, v = asyncio.run(main())
    assert set(d.metrics.collectors) == DAEMON_COLLECTORS
    for name in DAEMON_COLLECTORS:
        assert v("gpuguard_collector_success", {"collector": name}) == 1.0, name
        assert 0 <= v("gpuguard_collector_duration_seconds", {"collector": name}) < 5, name
    # the sources' own families are there beside them
    assert v("gpuguard_gpu_vram_total_bytes", {"gpu": "0000:05:00.0"}) == 34208743424
    downgraded = [s for f in d.metrics.registry.collect() if f.name == "gpuguard_pcie_link_downgraded"
                  for s in f.samples if s.value == 1]
    assert downgraded  # the XTX slot hop trained at Gen2 (INCIDENTS §4)


def test_a_raising_collector_scores_zero_and_the_others_still_answer(caplog):
    hub = Hub()
    sink = MetricsSink(hub)
    calls = []

    def broken():
        calls.append(1)
        if len(calls) > 1:  # fine at registration, broken at scrape (a bug reached at runtime)
            raise RuntimeError("ledger unreadable")
        yield _gauge("gpuguard_test_broken", 1)

    sink.add("broken", broken)
    sink.add("fine", lambda: [_gauge("gpuguard_test_fine", 7)])
    client = TestClient(build_app(hub, sink))
    with caplog.at_level(logging.ERROR, "gpuguard.metrics"):
        for _ in range(3):
            r = client.get("/metrics")
            assert r.status_code == 200
    v = sink.registry.get_sample_value
    assert v("gpuguard_collector_success", {"collector": "broken"}) == 0.0
    assert v("gpuguard_test_broken") is None  # nothing of a failed collector, not a stale value
    assert v("gpuguard_collector_success", {"collector": "fine"}) == 1.0
    assert v("gpuguard_test_fine") == 7.0
    assert v("gpuguard_build_info", {"version": __import__("gpuguard").__version__}) == 1.0
    assert v("gpuguard_collector_duration_seconds", {"collector": "broken"}) >= 0
    # the served text parses and names the failing collector
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert {s.labels["collector"]: s.value for s in fams["gpuguard_collector_success"].samples}["broken"] == 0.0
    # logged once on the change, not once per scrape
    failed = [rec for rec in caplog.records if "broken" in rec.getMessage()]
    assert len(failed) == 1 and "ledger unreadable" in failed[0].getMessage()


def test_a_family_two_collectors_export_is_refused_at_registration_naming_both():
    sink = MetricsSink(Hub())
    with pytest.raises(CollectorError, match=r"gpuguard_gpu_up .*'gpu'.*'mine'"):
        sink.add("mine", lambda: [_gauge("gpuguard_gpu_up", 1)])
    assert "mine" not in sink.collectors
    with pytest.raises(CollectorError, match="registered twice"):
        sink.add("gpu", lambda: [])
    with pytest.raises(CollectorError, match="gpuguard_collector_success"):
        sink.add("sneaky", lambda: [_gauge("gpuguard_collector_success", 1)])


def test_a_duplicate_family_that_first_appears_at_scrape_fails_only_the_late_collector():
    hub = Hub()
    sink = MetricsSink(hub)
    late: list = []
    sink.add("first", lambda: [_gauge("gpuguard_test_shared", 1)])
    sink.add("second", lambda: list(late))  # yields nothing at registration (no data yet)
    late.append(_gauge("gpuguard_test_shared", 2))
    text = sink.render().decode()
    assert text.count("# TYPE gpuguard_test_shared gauge") == 1  # Prometheus would reject the target
    v = sink.registry.get_sample_value
    assert v("gpuguard_test_shared") == 1.0
    assert v("gpuguard_collector_success", {"collector": "first"}) == 1.0
    assert v("gpuguard_collector_success", {"collector": "second"}) == 0.0


def test_add_producer_still_registers_under_a_derived_name():
    from gpuguard.policy import power_watch

    sink = MetricsSink(Hub())

    class Watch:
        __module__ = power_watch.__name__

        def metrics(self):
            yield _gauge("gpuguard_test_watch", 3)

    assert sink.add_producer(Watch().metrics) == "power_watch"
    assert sink.add_producer(lambda: [_gauge("gpuguard_test_other", 1)]) == "test_metrics_collectors"
    v = sink.registry.get_sample_value
    assert v("gpuguard_test_watch") == 3.0
    assert v("gpuguard_collector_success", {"collector": "power_watch"}) == 1.0


def _without_durations(text: str) -> list[str]:
    # the one line that differs between two renders of the same state
    return [line for line in text.splitlines() if not line.startswith(f"{DURATION}{{")]


def test_a_block_whose_inputs_did_not_change_is_served_as_rendered_and_redone_when_they_do():
    sink = MetricsSink(Hub())
    calls = []
    state = {"report": object(), "value": 1.0}

    def collect():
        calls.append(state["value"])
        yield _gauge("gpuguard_test_cached", state["value"])

    sink.add("cached", collect, inputs=lambda: same_objects(state["report"]))
    registered = len(calls)  # add() runs collect once to learn the families
    first = sink.render().decode()
    state["value"] = 2.0  # changed behind the key's back: the key decides, and it did not change
    second = sink.render().decode()
    assert len(calls) == registered + 1
    assert "gpuguard_test_cached 1.0" in first and "gpuguard_test_cached 1.0" in second
    state["report"] = object()  # a new report object: rendered anew
    third = sink.render().decode()
    assert len(calls) == registered + 2 and "gpuguard_test_cached 2.0" in third
    # the cached path is still timed and scored per collector
    assert f'{SUCCESS}{{collector="cached"}} 1.0' in third and f'{DURATION}{{collector="cached"}}' in third


def test_a_collector_that_raises_is_never_served_from_the_cache(caplog):
    sink = MetricsSink(Hub())
    state = {"fail": False}

    def collect():
        if state["fail"]:
            raise RuntimeError("source broke")
        yield _gauge("gpuguard_test_flaky", 3.0)

    sink.add("flaky", collect, inputs=lambda: ("same key",))
    assert "gpuguard_test_flaky 3.0" in sink.render().decode()
    state["fail"] = True
    text = sink.render().decode()
    # same key, so the cached (good) block is served; the failure shows once the key moves
    assert "gpuguard_test_flaky 3.0" in text
    sink._sources["flaky"].inputs = lambda: ("another key",)
    with caplog.at_level(logging.ERROR, logger="gpuguard.metrics"):
        text = sink.render().decode()
    assert "gpuguard_test_flaky" not in text.replace("# HELP gpuguard_test_flaky", "")
    assert f'{SUCCESS}{{collector="flaky"}} 0.0' in text
    text = sink.render().decode()  # a failed render is not cached: it is tried again
    assert f'{SUCCESS}{{collector="flaky"}} 0.0' in text and "source broke" in caplog.text


def test_render_serves_the_same_text_as_client_python_over_every_family(tmp_path, monkeypatch):
    """The cached, per-collector render of a whole daemon equals generate_latest over the
    registry (which collects every family afresh), line for line but the durations."""
    cfg = incident_host_config(tmp_path, monkeypatch, f"""
kernel: {{kmsg_path: {tmp_path / 'kmsg'}, udev: false}}
power: {{sampler: false}}
""")

    async def main():
        d = Daemon(cfg)
        try:
            await d.poller.poll_once()
            await d.pcie.check_once()
            d.metrics.render()  # fills the cache
            await d.poller.poll_once()  # a new GPU snapshot; the PCIe block stays cached
            d.recorder.query("SELECT 1")  # its queued rows are written: the file size holds still
            cached = d.metrics.render().decode()
            fresh = generate_latest(d.metrics.registry).decode()
            return cached, fresh
        finally:
            d.poller.close()
            d.power.close()
            if d.recorder is not None:
                d.recorder.close()

    cached, fresh = asyncio.run(main())
    assert "gpuguard_pcie_link_downgraded" in cached and "gpuguard_gpu_up" in cached
    assert _without_durations(cached) == _without_durations(fresh)


def test_a_keyed_family_is_built_and_rendered_again_only_when_its_key_changes():
    """Issue 15: what did not change is served as rendered (the GPUs' identities, caps and
    limits: 60 % of the GPU block), without building it; the registry view still sees it."""
    from gpuguard.sinks.metrics import Keyed

    sink = MetricsSink(Hub())
    cap = [300.0]
    built: list[float] = []
    live = [1.0]

    def build() -> GaugeMetricFamily:
        built.append(cap[0])
        return _gauge("gpuguard_test_cap_watts", cap[0])

    sink.add("caps", lambda: [Keyed("gpuguard_test_cap_watts", (cap[0],), build), _gauge("gpuguard_test_live", live[0])])
    built.clear()  # registration reads names only
    first = sink.render()
    live[0] = 2.0
    second = sink.render()
    assert built == [300.0]  # the second scrape did not build the family
    assert b"gpuguard_test_cap_watts 300.0" in second and b"gpuguard_test_live 2.0" in second
    assert first.replace(b"gpuguard_test_live 1.0", b"gpuguard_test_live 2.0").split(b"# HELP gpuguard_collector")[0] \
        == second.split(b"# HELP gpuguard_collector")[0]
    cap[0] = 250.0  # a profile lowered the cap
    third = sink.render()
    assert built == [300.0, 250.0] and b"gpuguard_test_cap_watts 250.0" in third and b"300.0" not in third
    assert sink.registry.get_sample_value("gpuguard_test_cap_watts") == 250.0


def test_the_gpu_blocks_slow_families_follow_a_changed_cap(tmp_path, monkeypatch):
    """The keyed GPU families are the daemon's: a cap changed on the card shows at the next
    poll's scrape, the identity rendered once stays."""
    config = incident_host_config(tmp_path, monkeypatch, "")
    daemon = Daemon(config)
    host_root = tmp_path / "root"
    cap_files = sorted(host_root.glob("sys/class/drm/card*/device/hwmon/hwmon*/power1_cap"))
    assert cap_files

    async def two_polls() -> tuple[bytes, bytes]:
        await daemon.poller.poll_once()
        before = daemon.metrics.render()
        cap_files[0].write_text("210000000\n")
        await daemon.poller.poll_once()
        return before, daemon.metrics.render()

    try:
        before, after = asyncio.run(two_polls())
    finally:
        daemon.poller.close()
    caps = lambda body: sorted(s.value for f in text_string_to_metric_families(body.decode())
                               if f.name == "gpuguard_gpu_power_cap_watts" for s in f.samples)
    assert 210.0 not in caps(before) and 210.0 in caps(after)
    info = lambda body: [ln for ln in body.splitlines() if ln.startswith(b"gpuguard_gpu_info{")]
    assert info(before) == info(after) and len(info(after)) == 4
