"""`gpuguard config check FILE`: validate a config file; each problem names key and line."""
from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="config file tools")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION")
    c = csub.add_parser("check", help="validate a config file")
    c.add_argument("file")
    c.set_defaults(func=cmd_check)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def cmd_check(args: argparse.Namespace) -> int:
    from gpuguard.config import ConfigError, load_config

    try:
        load_config(args.file)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 1
    print(f"{args.file}: OK")
    return 0
