"""Memory is paid per feature: a daemon with no engine and no webhook configured never
imports httpx (~5-7 MiB with what it pulls in); the first engine probe or webhook does."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import httpx
import pytest

from gpuguard.sim.runner import build_scenario
from gpuguard.sim.tree import write_tree

DAEMON = os.path.join(os.path.dirname(__file__), "..", "..", "daemon")


def run_daemon_cycle(tmp_path, extra: str) -> list[str]:
    write_tree(build_scenario("incident"), str(tmp_path / "root"))
    (tmp_path / "kmsg").write_text("")
    code = textwrap.dedent(f"""
        import asyncio, sys
        from gpuguard.config import parse_config
        from gpuguard.daemon import Daemon
        cfg = parse_config('''
        sysfs_root: {tmp_path / 'root'}
        state_dir: {tmp_path / 'state'}
        listen: {{address: 127.0.0.1, port: 0}}
        kernel: {{kmsg_path: {tmp_path / 'kmsg'}, udev: false}}
        {extra}
        ''')
        async def main():
            d = Daemon(cfg)
            await d.poller.poll_once()
            await d.pcie.check_once()
            d.metrics.render()
            d.poller.close(); d.power.close(); d.recorder.close()
        asyncio.run(main())
        print(" ".join(sorted(m for m in ("httpx", "httpcore", "rich") if m in sys.modules)))
    """)
    env = dict(os.environ, PYTHONPATH=DAEMON)
    env.pop("NOTIFY_SOCKET", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.split()


def test_a_daemon_without_engines_or_webhooks_never_imports_httpx(tmp_path):
    assert run_daemon_cycle(tmp_path, "") == []


def test_the_first_engine_probe_imports_it():
    code = textwrap.dedent("""
        import asyncio, sys
        from gpuguard.engines.adapters import Adapter
        from gpuguard.engines.config import EngineConfig
        from gpuguard.engines.probe import EngineProbe
        assert "httpx" not in sys.modules
        cfg = EngineConfig(name="e", kind="vllm", url="http://127.0.0.1:9", process={"cmdline": "no-such-engine-xyz"})
        probe = EngineProbe(Adapter(cfg))
        r = asyncio.run(probe.poll())
        print(r.health, "httpx" in sys.modules)
    """)
    env = dict(os.environ, PYTHONPATH=DAEMON)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["refused", "True"]


def _imported(log: str) -> set[str]:
    """Modules named by `-X importtime` lines (PYTHONPROFILEIMPORTTIME) in a log."""
    out = set()
    for line in log.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            out.add(line.rsplit("|", 1)[1].strip())
    return out


def test_a_command_named_first_imports_its_own_module_only():
    code = textwrap.dedent("""
        import sys
        from gpuguard import cli
        cli.parser_for(["run", "--config", "x.yaml"]).parse_args(["run", "--config", "x.yaml"])
        print(" ".join(sorted(m for m in sys.modules if m.startswith("gpuguard.cli."))))
        print("httpx" in sys.modules)
        # a command its module's name does not say (uninstall-service lives in install_service)
        args = cli.parser_for(["uninstall-service", "--dry-run"]).parse_args(["uninstall-service", "--dry-run"])
        print(args.command)
    """)
    env = dict(os.environ, PYTHONPATH=DAEMON)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines() == ["gpuguard.cli.run", "False", "uninstall-service"]


def test_an_unknown_command_still_gets_the_whole_list():
    p = subprocess.run([sys.executable, "-m", "gpuguard", "statsu"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=DAEMON), timeout=120)
    assert p.returncode == 2 and "invalid choice: 'statsu'" in p.stderr and "'status'" in p.stderr


@pytest.mark.slow
@pytest.mark.network
def test_the_daemon_serves_reads_without_fastapi_and_loads_it_for_the_first_action(tmp_path, start_daemon):
    """Issue 15: FastAPI is 11 MiB of a 48 MiB budget. The real `gpuguard run`, scraped and
    read (page, status, history, GPUs) imports neither FastAPI nor the CLI's client nor
    the engine watchdog nor anyio's thread pool; the first request for an action route
    builds the control app."""
    write_tree(build_scenario("incident"), str(tmp_path / "root"))
    (tmp_path / "kmsg").write_text("")
    d = start_daemon(tmp_path / "root", f"kernel: {{kmsg_path: {tmp_path / 'kmsg'}, udev: false}}\n",
                     env={"PYTHONPROFILEIMPORTTIME": "1"})
    with httpx.Client(base_url=d.base, timeout=10) as c:
        for path in ("/metrics", "/healthz", "/v1/status", "/v1/gpus", "/v1/events", "/", "/v1/history",
                     "/v1/config", "/metrics"):
            assert c.get(path).status_code == 200, path
        assert c.head("/metrics").status_code == 200
        before = _imported(d.log.read_text())
        assert "gpuguard.daemon" in before  # the log does hold the daemon's imports
        # anyio's asyncio backend (21 modules and a worker thread: 1.1 MiB at the first read)
        # is Starlette's thread pool; the blocking reads use asyncio's own
        for module in ("fastapi", "httpx", "gpuguard.control.routes", "gpuguard.engines.watchdog",
                       "psutil", "gpuguard.cli.status", "gpuguard.report.make", "anyio.lowlevel",
                       "anyio.streams.memory"):
            assert module not in before, f"{module} imported by a daemon that was only read"
        r = c.post("/v1/gpus/r9700-a/reset", json={})
        assert r.status_code == 401 and r.json()["detail"].startswith("this call needs a bearer token")
    after = _imported(d.log.read_text())
    assert {"fastapi", "gpuguard.control.routes"} <= after
