"""`gpuguard run --config FILE`: the daemon."""
from __future__ import annotations

import argparse
import asyncio
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the daemon (poller, /metrics, API)")
    p.add_argument("--config", "-c", default=None, help="config file (default: built-in defaults)")
    p.add_argument("--sysfs-root", default=None, help="read hardware below DIR instead of /")
    p.add_argument("--listen", default=None, help="override listen address HOST:PORT")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
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
    from gpuguard.profiles import attach

    attach(daemon)
    try:
        return asyncio.run(daemon.run())
    except RuntimeError as e:
        print(f"gpuguard: {e}", file=sys.stderr)
        return 1
