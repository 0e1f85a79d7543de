"""Memory is paid per feature: a daemon with no engine and no webhook configured never
imports httpx (~5-7 MiB with what it pulls in); the first engine probe or webhook does."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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
