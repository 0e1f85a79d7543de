"""Config validation names the key; process resolution finds the engine afresh each time
(pid file, command line, GPU-owning child) and says clearly when it cannot."""
from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from gpuguard.engines.adapters import Adapter
from gpuguard.engines.config import EngineConfig, EnginesConfig
from gpuguard.engines.exposition import Samples, Selector
from gpuguard.engines.process import ProcessLookupFailed, read_proc_stat, resolve

from engines_harness import engine_cfg, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


def test_config_errors_name_the_key():
    with pytest.raises(ValidationError, match="exactly one of systemd_unit, cgroup, pid_file, cmdline"):
        engine_cfg("e", "vllm", "http://127.0.0.1:1", process={"systemd_unit": "a", "cmdline": "b"})
    with pytest.raises(ValidationError, match="kind generic needs metrics.heartbeat"):
        engine_cfg("e", "generic", "http://127.0.0.1:1", process={"cmdline": "x"})
    with pytest.raises(ValidationError, match="invalid regex"):
        engine_cfg("e", "vllm", "http://127.0.0.1:1", process={"cmdline": "("})
    with pytest.raises(ValidationError, match="stall_afterr"):
        engine_cfg("e", "vllm", "http://127.0.0.1:1", process={"cmdline": "x"}, stall_afterr=3)
    with pytest.raises(ValidationError, match="duplicate name"):
        EnginesConfig.model_validate({"engines": [
            {"name": "a", "kind": "vllm", "url": "http://h:1", "process": {"cmdline": "x"}}] * 2})
    cfg = engine_cfg("e", "vllm", "http://127.0.0.1:1/", process={"cmdline": "x"})
    assert cfg.url == "http://127.0.0.1:1" and cfg.stall_after == 60.0 and cfg.action == "alert"


def test_generic_selectors_from_config():
    cfg = EngineConfig.model_validate({
        "name": "tgi", "kind": "generic", "url": "http://h:1", "process": {"cmdline": "x"},
        "metrics": {"running": ["tgi_batch_current_size"], "waiting": ["tgi_queue_size"],
                    "heartbeat": ['tgi_batch_inference_count{method="decode"}',
                                  'tgi_batch_inference_count{method="prefill"}']}})
    text = ('# TYPE tgi_batch_current_size gauge\ntgi_batch_current_size 2\n'
            '# TYPE tgi_queue_size gauge\ntgi_queue_size 1\n'
            '# TYPE tgi_batch_inference_count counter\n'
            'tgi_batch_inference_count{method="decode"} 100\ntgi_batch_inference_count{method="prefill"} 7\n')
    r = Adapter(cfg).read(Samples.parse(text))
    assert (r.running, r.waiting, r.heartbeat) == (2.0, 1.0, 107.0)
    with pytest.raises(ValueError, match="not `name"):
        Selector.parse("bad selector{")


def test_absent_metric_is_none_not_zero():
    cfg = engine_cfg("e", "vllm", "http://127.0.0.1:1", process={"cmdline": "x"})
    r = Adapter(cfg).read(Samples.parse("# TYPE other gauge\nother 1\n"))
    assert r.running is None and r.heartbeat is None and r.pending is None
    with pytest.raises(ValueError, match="not Prometheus exposition"):
        Samples.parse("{{{ garbage", "http://x/metrics")


def test_resolve_pid_file_and_vllm_engine_core(tmp_path, sims):
    pidf = tmp_path / "v.pid"
    sim = sims("vllm", "--pid-file", str(pidf))
    cfg = engine_cfg("v", "vllm", sim.url, process={"pid_file": str(pidf)})
    wait_for(lambda: len(sim.tree()) == 2, 5, what="EngineCore child")
    procs = resolve(cfg)
    assert procs.main_pid == sim.pid
    assert procs.gpu_pid != sim.pid and procs.gpu_pid in procs.pids  # the EngineCore child
    assert set(sim.tree()) <= set(procs.pids)  # the tree: what the kill takes, nothing else
    by_cmd = resolve(engine_cfg("v", "vllm", sim.url, process={"cmdline": rf"--kind vllm --port {sim.port}( |$)"}))
    assert by_cmd.main_pid == sim.pid and by_cmd.gpu_pid == procs.gpu_pid
    sim.stop()
    assert resolve(cfg) is None  # stale pid file: the PID is gone, not reused blindly


def test_pid_file_older_than_the_process_is_stale(tmp_path):
    """The PID in a pid file written before that process started belongs to someone else."""
    import subprocess
    engine = subprocess.Popen(["sleep", "60"])
    try:
        pidf = tmp_path / "e.pid"
        pidf.write_text(f"{engine.pid}\n")
        cfg = engine_cfg("e", "vllm", "http://h:1", process={"pid_file": str(pidf)})
        assert resolve(cfg).main_pid == engine.pid  # written after the process started: valid
        os.utime(pidf, (0, 0))  # written in 1970, long before this process started
        assert resolve(cfg) is None
    finally:
        engine.kill()
        engine.wait(5)


def test_resolve_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.pid"
    bad.write_text("not-a-pid\n")
    with pytest.raises(ProcessLookupFailed, match=r"bad.pid: 'not-a-pid' is not a PID"):
        resolve(engine_cfg("e", "vllm", "http://h:1", process={"pid_file": str(bad)}))
    assert resolve(engine_cfg("e", "vllm", "http://h:1", process={"pid_file": str(tmp_path / "none")})) is None
    with pytest.raises(ProcessLookupFailed, match="unit nope.service"):
        # no systemd here (or no such unit): the error names the unit either way
        resolve(engine_cfg("e", "vllm", "http://h:1", process={"systemd_unit": "nope.service"}))


def test_read_proc_stat_self():
    st = read_proc_stat(os.getpid())
    assert st.pid == os.getpid() and st.state in "RS" and st.cpu_seconds > 0 and st.start_time > 1e9
    assert read_proc_stat(2**22 + 12345) is None
