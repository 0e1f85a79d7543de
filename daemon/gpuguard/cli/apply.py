"""`gpuguard apply [--profile P] [GPU…] [--dry-run] [--reset GPU]`: put profiles on cards
by hand, one card at a time, and print per card the values before → written → read back.
Exits 0 only when every card read back equal (issue: "Applied" means read back equal)
and every configured card is present and identified: a missing card is named and the
exit status is 1, with --dry-run too (INCIDENTS §2: the boot script that "applied" to the
one card it found). Cards of an incomplete `{pci_id, index}` group are not identified,
so nothing is planned for them (state/identity.py).

Without --profile each GPU gets the profile assigned in the config (`gpus[].profile`).
GPUs are named as in the config, or by PCI address. Who asked is recorded as `cli`
(plus $SUDO_USER/$USER) in the audit log."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("apply", help="apply (or --reset) clock/voltage/power profiles, read back, verify",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gpus", nargs="*", metavar="GPU", help="GPU names or PCI addresses (default: every GPU with a profile)")
    p.add_argument("--profile", "-p", default=None, help="apply this profile instead of each GPU's assigned one")
    p.add_argument("--dry-run", action="store_true", help="validate and show the writes; write nothing")
    p.add_argument("--reset", action="append", default=[], metavar="GPU",
                   help="write `r` (+`c` where needed) and the default power cap, verify stock values")
    p.add_argument("--config", "-c", metavar="FILE", default=None, help="config file (profiles, GPU names)")
    p.add_argument("--sysfs-root", metavar="DIR", default=None, help="hardware below DIR instead of /")
    p.add_argument("--why", default="by hand", help="reason recorded in the audit log")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_apply)


def _fmt(v: Any) -> str:
    return "—" if v is None else str(v)


def render(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        head = f"{r['gpu']} ({r['bdf']}) profile {r['profile']}: "
        head += "VERIFIED" if r["verified"] else ("dry run" if r["result"] == "dry-run" else f"NOT VERIFIED ({r['result']})")
        lines.append(head)
        keys = list(r["expected"]) or sorted(set(r["before"]) | set(r["readback"]))
        if keys:
            lines.append(f"  {'setting':<20} {'before':>8} {'written':>10} {'read back':>10}")
            for k in keys:
                after = r["readback"].get(k) if r["result"] != "dry-run" else None
                mark = "" if r["result"] == "dry-run" or after == r["expected"].get(k) else "  ≠"
                lines.append(f"  {k:<20} {_fmt(r['before'].get(k)):>8} {_fmt(r['expected'].get(k)):>10} {_fmt(after):>10}{mark}")
        shown = r["planned"] if r["result"] == "dry-run" else r["written"]
        if shown:
            lines.append(("  would write: " if r["result"] == "dry-run" else "  writes: ") + "; ".join(shown))
        if not r["verified"] and r["result"] != "dry-run":
            lines.append(f"  {r['message']}")
    return "\n".join(lines)


def cmd_apply(args: argparse.Namespace) -> int:
    from gpuguard.config import ConfigError, load_config
    from gpuguard.hw import amdgpu
    from gpuguard.hw.sysfs import SysfsRoot
    from gpuguard.profiles.apply import Applier, CardTarget
    from gpuguard.profiles.safemode import SafeModeGuard
    from gpuguard.profiles.schema import ProfilesConfig
    from gpuguard.state.audit import AuditLog, AuditUnavailable
    from gpuguard.state.identity import identify

    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 2
    try:
        pc = ProfilesConfig.from_root(config)
    except ValueError as e:
        print(f"{args.config}: {e}", file=sys.stderr)
        return 2
    root = SysfsRoot(args.sysfs_root or config.sysfs_root)
    devices = amdgpu.discover(root)
    from gpuguard.profiles import nvidia

    audit = AuditLog.in_state_dir(pc.state_dir)
    nv_devices, nv_applier = nvidia.host_nvidia(root.root, audit.profile_record, pc.apply.retries, pc.apply.backoff_seconds)
    ident = identify([*devices, *nv_devices], config.gpus)
    names = {d.bdf: ident.name(d.bdf) for d in [*devices, *nv_devices]}
    by_key = {**{b: b for b in names}, **{n: b for b, n in names.items()}}
    who = f"cli:{os.environ.get('SUDO_USER') or os.environ.get('USER') or os.getuid()}"
    applier = Applier(root, audit=audit.profile_record, retries=pc.apply.retries, backoff=pc.apply.backoff_seconds)
    if nv_applier is not None:  # NVIDIA cards through NVML, same table
        applier = nvidia.VendorApplier(applier, nv_applier, nv_devices)

    def recorded_first(gpu: str, what: str, why: str) -> bool:
        """No audit record, no write: the record of the change goes first."""
        if args.dry_run:
            return True
        try:
            audit.profile_started(gpu, what, who, why)
        except AuditUnavailable as e:
            print(f"gpuguard apply: {gpu}: refused, nothing written: {e} (free space or fix state_dir)", file=sys.stderr)
            return False
        return True

    def resolve(keys: list[str]) -> list[str] | None:
        out = []
        for k in keys:
            bdf = by_key.get(k) or by_key.get(f"0000:{k}")
            gone = [m for m in ident.missing if m.name == k]
            if bdf is None and gone:
                print(f"gpuguard apply: configured GPU {gone[0].label()} is missing: {gone[0].why}", file=sys.stderr)
                return None
            if bdf is None:
                print(f"gpuguard apply: no GPU {k!r}; present: {', '.join(f'{n} ({b})' for b, n in names.items()) or 'none'}",
                      file=sys.stderr)
                return None
            out.append(bdf)
        return out

    results = []
    if args.reset:
        bdfs = resolve(args.reset)
        if bdfs is None:
            return 2
        for b in bdfs:
            if not recorded_first(names[b], "stock", f"reset to stock: {args.why}"):
                return 1
            results.append(applier.reset(CardTarget(names[b], b), who, f"reset to stock: {args.why}", args.dry_run))
    else:
        if args.profile is not None and args.profile not in pc.profiles:
            print(f"gpuguard apply: no profile {args.profile!r}; defined: {', '.join(sorted(pc.profiles)) or 'none'}",
                  file=sys.stderr)
            return 2
        bdfs = resolve(args.gpus) if args.gpus else sorted(
            b for b, n in names.items() if b in ident.names and (args.profile or n in pc.assignments))
        if bdfs is None:
            return 2
        if not bdfs and not ident.missing:
            where = f"in {args.config}" if args.config else "without --config (the built-in defaults assign none)"
            print(f"gpuguard apply: no GPU has a profile assigned (gpus[].profile) {where}, and none was named; "
                  "give --config FILE, or --profile P with the GPUs", file=sys.stderr)
            return 2
        for b in bdfs:  # one card at a time
            pname = args.profile or pc.assignments.get(names[b])
            if pname is None:
                print(f"gpuguard apply: {names[b]} has no profile assigned; give --profile", file=sys.stderr)
                return 2
            if not recorded_first(names[b], pname, args.why):
                return 1
            results.append(applier.apply(CardTarget(names[b], b), pname, pc.profiles[pname], who, args.why, args.dry_run))
        if not args.dry_run and all(r.verified for r in results):
            SafeModeGuard(pc.state_dir, root).clear()  # a person applied by hand: leave safe mode
    out = [r.to_dict() for r in results]
    # configured cards that are not there (or not identifiable) are named: exit 1
    wanted = set(args.gpus) if args.gpus else None
    missing = [m for m in ident.missing if wanted is None or m.name in wanted]
    if args.json:
        print(json.dumps({"results": out, "missing": [{"gpu": m.name, "match": m.match, "why": m.why}
                                                      for m in missing]}, indent=2, sort_keys=True))
    else:
        if out:
            print(render(out))
        for m in missing:
            print(f"{m.label()}: MISSING: {m.why}; nothing applied to it")
    for m in missing:
        print(f"gpuguard apply: configured GPU {m.label()} is missing: {m.why}", file=sys.stderr)
    if missing:
        return 1
    if args.dry_run:
        return 0 if all(r.result == "dry-run" for r in results) else 1
    return 0 if all(r.verified for r in results) else 1
