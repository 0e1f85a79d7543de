"""`gpuguard doctor`: runs every PCIe / BAR / P2P / AtomicOps / AER check, the expected
links from the config and the telemetry sanity checks, and prints one verdict line per
finding (OK / WARN / FAIL, what, where, what to do). Exit status: 0 all OK, 1 warnings,
2 failures. Reads only."""
from __future__ import annotations

import json
import os
import sys

from gpuguard.cli.pcie import add_source_args, load
from gpuguard.hw.pcie_capture import CaptureError
from gpuguard.policy.doctor import ConfigError, Finding, diagnose, exit_status, load_expected_links, resolve_expected


def exposure_findings(path: str) -> list[Finding]:
    """WARN for what the config leaves reachable from the network without a token
    (issue 12 item 9). Raises ConfigError for a file `run` would refuse."""
    from gpuguard.config import ConfigError as FileError, load_config
    from gpuguard.sinks.auth import exposure_warnings

    try:
        cfg = load_config(path)
    except FileError as e:
        raise ConfigError(e.render()) from None
    where = f"{cfg.listen.address}:{cfg.listen.port}"
    return [Finding("WARN", "api", w, where, "set api.token_file and api.open_reads: false, or listen on 127.0.0.1")
            for w in exposure_warnings(cfg.listen.address, cfg.api.open_reads, cfg.api.token_file)]


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="check PCIe links, BARs, P2P, AtomicOps, AER and telemetry; exit non-zero on problems")
    add_source_args(p)
    p.add_argument("--config", metavar="FILE", help="gpuguard config with gpus[].expect_link")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        exposure = exposure_findings(args.config) if args.config else []
        rules = load_expected_links(args.config) if args.config else []
    except ConfigError as e:
        print(f"gpuguard doctor: {e}", file=sys.stderr)
        return 2
    try:
        src, report, lines = load(args)
    except (CaptureError, OSError) as e:
        print(f"gpuguard doctor: {e}", file=sys.stderr)
        return 2
    try:
        findings = diagnose(src.root, report, resolve_expected(rules, report), lines) + exposure
    finally:
        src.close()
    status = exit_status(findings)
    if args.json:
        json.dump({"status": status, "findings": [f.to_dict() for f in findings]}, sys.stdout, indent=2)
        print()
        return status
    colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    codes = {"OK": "32", "WARN": "33", "FAIL": "1;31"}
    for f in findings:
        line = f.line()
        if colour:
            line = f"\033[{codes[f.level]}m{line[:4]}\033[0m{line[4:]}"
        print(line)
    counts = {lv: sum(f.level == lv for f in findings) for lv in ("OK", "WARN", "FAIL")}
    print(f"{counts['FAIL']} FAIL, {counts['WARN']} WARN, {counts['OK']} OK")
    return status
