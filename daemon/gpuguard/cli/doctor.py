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
from gpuguard.policy.doctor import Finding, diagnose, exit_status, expected_from_config
from gpuguard.policy.link_history import FILE as HISTORY_FILE, KERNEL_FILE, boot_time, load as load_history, load_kernel_lines


def exposure_findings(cfg) -> list[Finding]:
    """WARN for what the config leaves reachable from the network without a token."""
    from gpuguard.control.auth import exposure_warnings

    where = f"{cfg.listen.address}:{cfg.listen.port}"
    return [Finding("WARN", "api", w, where, "set api.token_file and api.open_reads: false, or listen on 127.0.0.1")
            for w in exposure_warnings(cfg.listen.address, cfg.api.open_reads, cfg.api.token_file)]


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="check PCIe links, BARs, P2P, AtomicOps, AER and telemetry; exit non-zero on problems",
                              description=__doc__)
    add_source_args(p)
    p.add_argument("--config", "-c", metavar="FILE",
                   help="gpuguard config (read by the daemon's own loader) with gpus[].expect_link")
    p.add_argument("--history", metavar="FILE",
                   help="the daemon's PCIe load history (default: STATE_DIR/pcie-load-history.json of --config, "
                        "or /var/lib/gpuguard/ on the real host): a link the daemon saw slow under load is "
                        "judged 'downgraded under load' even while the GPU idles now")
    p.set_defaults(func=run)


def run(args) -> int:
    entries: list = []
    exposure: list = []
    cfg = None
    if args.config:
        # One loader for everything: what the daemon accepts, doctor accepts.
        from gpuguard.config import ConfigError, load_config

        try:
            cfg = load_config(args.config)
            entries, state_dir = list(cfg.gpus), cfg.state_dir
            exposure = exposure_findings(cfg)
        except ConfigError as e:
            print(f"gpuguard doctor: {e.render()}", file=sys.stderr)
            return 2
        if args.sysfs_root is None:  # the tree the daemon with this config reads; --sysfs-root wins
            args.sysfs_root = cfg.sysfs_root
    else:
        state_dir = "/var/lib/gpuguard" if args.sysfs_root in (None, "/") and not args.replay else None
    try:
        # the kernel lines the daemon read (P2P refusals, BAR figures): a refusal it saw is
        # the pair's verdict here too, without --kernel-log
        src, report, lines = load(args, saved_kernel_lines=os.path.join(state_dir, KERNEL_FILE) if state_dir else None)
    except (CaptureError, OSError) as e:
        print(f"gpuguard doctor: {e}", file=sys.stderr)
        return 2
    try:
        history = args.history or (os.path.join(state_dir, HISTORY_FILE) if state_dir else None)
        seen = load_history(history, boot_time(src.root)) if history else {}
        findings = diagnose(src.root, report, expected_from_config(entries, report), lines, seen_under_load=seen) + exposure
    finally:
        src.close()
    if args.config:  # the PSU budget from the flight recorder (INCIDENTS §2)
        from gpuguard.policy.power_doctor import power_findings_from_file

        findings += power_findings_from_file(args.config)
    if cfg is not None:  # INCIDENTS §10: engines open to the network without a key
        from gpuguard.policy.engine_doctor import engine_findings

        findings += engine_findings(cfg.engines)
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
