"""`gpuguard run --config FILE`: the daemon. Polls the GPUs, walks PCIe, applies and
verifies profiles, watches engines and the kernel log, records, and serves /metrics, the
page and the control API on `listen:` until SIGTERM/SIGINT; SIGHUP re-reads the config.
Exit 2: the config is invalid (each problem names its key and line)."""
from __future__ import annotations

import argparse
import asyncio
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the daemon (poller, /metrics, API)", description=__doc__)
    p.add_argument("--config", "-c", metavar="FILE", default=None, help="config file (default: built-in defaults)")
    p.add_argument("--sysfs-root", metavar="DIR", default=None, help="read hardware below DIR instead of /")
    p.add_argument("--listen", metavar="HOST:PORT", default=None, help="override listen address HOST:PORT")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from gpuguard.heap import return_large_blocks

    return_large_blocks()  # before the daemon allocates anything large (gpuguard/heap.py)
    from gpuguard.config import ConfigError, load_config
    from gpuguard.daemon import Daemon
    from gpuguard.logsetup import setup_logging

    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 2
    if args.listen:
        host, _, port = args.listen.rpartition(":")
        config = config.model_copy(update={"listen": config.listen.model_copy(update={"address": host or "127.0.0.1", "port": int(port)})})
    setup_logging(config.logging.level)
    daemon = Daemon(config, config_path=args.config, sysfs_root=args.sysfs_root)
    try:
        code = run_bounded(daemon.run())
    except RuntimeError as e:
        print(f"gpuguard: {e}", file=sys.stderr)
        code = 1
    exit_now_if_stuck(code)
    return code


def run_bounded(main) -> int:
    """asyncio.run, except that closing the loop does not wait for executor threads: a
    thread stuck in a wedged device would hold the stop past systemd's TimeoutStopSec.
    Leftover tasks get a short grace, then the loop closes."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            rest = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in rest:
                t.cancel()
            if rest:
                loop.run_until_complete(asyncio.wait(rest, timeout=1.0))
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), 1.0))
        except Exception:  # closing must not turn a clean stop into a traceback
            pass
        executor = getattr(loop, "_default_executor", None)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        asyncio.set_event_loop(None)
        loop.close()


def exit_now_if_stuck(code: int) -> None:
    """Threads still blocked in a device call (pool threads are joined at interpreter
    exit) would keep the process alive: flush and leave without waiting for them."""
    import logging
    import os
    import threading

    stuck = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if not stuck:
        return
    logging.getLogger("gpuguard").info("stop: %d worker thread(s) still running (%s); exiting without waiting for them",
                                       len(stuck), ", ".join(sorted(stuck)[:5]))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
