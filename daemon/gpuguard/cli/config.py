"""`gpuguard config check FILE`: validate a config file; each problem names key and line.
It refuses everything `gpuguard run` refuses at start (it said OK for a config
whose api.token_file did not exist): the file itself and the token file (present, a
regular file, mode 0600/0400, owned by the daemon's user)."""
from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="config file tools", description=__doc__)
    csub = p.add_subparsers(dest="config_command", metavar="ACTION")
    c = csub.add_parser("check", help="validate a config file", description=__doc__)
    c.add_argument("file", metavar="FILE")
    c.set_defaults(func=cmd_check)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def cmd_check(args: argparse.Namespace) -> int:
    from gpuguard.config import ConfigError, load_config
    from gpuguard.control.auth import TokenFileError, TokenStore, exposure_warnings

    try:
        config = load_config(args.file)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 1
    try:
        TokenStore.load(config.api.token_file)
    except TokenFileError as e:
        print(f"{args.file}: 1 problem(s)\n  {e}", file=sys.stderr)
        return 1
    for w in exposure_warnings(config.listen.address, config.api.open_reads, config.api.token_file):
        print(f"{args.file}: warning: {w}", file=sys.stderr)
    print(f"{args.file}: OK")
    return 0
