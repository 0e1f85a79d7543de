"""`gpuguard install-service` / `gpuguard uninstall-service`: set gpuguard up as a
systemd service from a pipx or venv install (gpuguard/install/service.py has the steps)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("install-service", help="write the systemd unit, config and token file; enable the service",
                       description=__doc__)
    p.add_argument("--root", metavar="DIR", default="/", help="install below DIR (an image or a test root); default /")
    p.add_argument("--exec", dest="executable", metavar="FILE", default=None,
                   help="the gpuguard the unit runs (default: this installation's bin/gpuguard)")
    p.add_argument("--now", action="store_true", help="also start it (systemctl enable --now; not below --root)")
    p.add_argument("--dry-run", action="store_true", help="print what would be done, change nothing")
    p.set_defaults(func=cmd_install)
    u = sub.add_parser("uninstall-service", help="stop and disable the service, remove its unit (config is kept)",
                       description=__doc__)
    u.add_argument("--root", metavar="DIR", default="/", help="uninstall below DIR; default /")
    u.add_argument("--dry-run", action="store_true", help="print what would be done, change nothing")
    u.set_defaults(func=cmd_uninstall)


def _run(plan, dry_run: bool) -> int:
    from gpuguard.install.service import InstallError, carry_out

    if dry_run:
        for line in plan.describe():
            print("would " + line)
        return 0
    if os.geteuid() != 0 and Path(plan.root).resolve() == Path("/"):
        print("gpuguard: installing a system service needs root (sudo); --dry-run shows the steps", file=sys.stderr)
        return 1
    try:
        carry_out(plan)
    except InstallError as e:
        print(f"gpuguard: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    from gpuguard.install.service import InstallError, default_executable, plan_install

    try:
        exe = Path(args.executable) if args.executable else default_executable()
        plan = plan_install(Path(args.root), exe, start=args.now)
    except InstallError as e:
        print(f"gpuguard: {e}", file=sys.stderr)
        return 1
    rc = _run(plan, args.dry_run)
    if rc == 0 and not args.dry_run:
        print("done. Check the config with `gpuguard config check /etc/gpuguard/gpuguard.yaml`, "
              "apply changes with `systemctl reload gpuguard`.")
    return rc


def cmd_uninstall(args: argparse.Namespace) -> int:
    from gpuguard.install.service import plan_uninstall

    return _run(plan_uninstall(Path(args.root)), args.dry_run)
