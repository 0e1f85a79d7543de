"""`gpuguard` command line. Each subcommand lives in its own module in this package and
exposes `register(subparsers)`; modules are found automatically, so adding a command is
adding one file (as node_exporter adds a collector)."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from gpuguard import __version__


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser, or only the commands of module `only`."""
    parser, _ = _parser(only)
    return parser


def _parser(only: str | None) -> tuple[argparse.ArgumentParser, set[str]]:
    parser = argparse.ArgumentParser(
        prog="gpuguard",
        description="Keeps GPU inference hosts alive: telemetry, PCIe, profiles, engine watchdog.",
    )
    parser.add_argument("--version", action="version", version=f"gpuguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_") or (only is not None and info.name != only):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser, set(sub.choices)


def parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """The parser for this command line: when its first word is a command defined by the
    module of that name (`run` in cli/run.py), that module alone is imported — each
    command module imports what it needs at the top, so `gpuguard run` would otherwise
    carry every command's libraries (the CLI's HTTP client, the PCIe printer, the report
    renderer: 2 MiB of the daemon's issue-15 budget) for its whole life."""
    if argv and not argv[0].startswith("-"):
        module = argv[0].replace("-", "_")
        if module in {m.name for m in pkgutil.iter_modules(__path__)}:
            parser, commands = _parser(module)
            if argv[0] in commands:
                return parser
    return build_parser()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = parser_for(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
