"""`gpuguard sim`: the simulator as a tool — list its scenarios and drive a running
`gpuguard demo` (or any host served with a control socket, sim/control.py).

    gpuguard sim scenarios                 one line per simulated host
    gpuguard sim status                    what the simulated cards are doing
    gpuguard sim lose GPU                  `device lost from bus!`, then the card leaves the bus
    gpuguard sim return GPU                the lost card comes back (a cold power-cycle)
    gpuguard sim return GPU --slot PORT    ... in the empty slot below PORT: at a new address
    gpuguard sim reset GPU                 a GPU reset: stock settings, kernel reset lines
    gpuguard sim wedge GPU FILE            reads of that sysfs file hang (unwedge GPU to release)
    gpuguard sim load GPU LEVEL|auto       pin the load (0..1), or back to the demo's pattern
    gpuguard sim engine stall|unstall|slow|hang|die
    gpuguard sim kmsg 'TEXT' [--gpu GPU] [--level 3]   a kernel log line

GPU is the configured name (xtx-0) or the PCI address. The simulated kernel log reaches
the daemon as kernel records, so kernel-triggered actions (mark lost, kill engines,
re-apply after a reset) happen as on a real host — no root, no real /dev/kmsg.
"""
from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="list simulated hosts; drive a running demo (lose a GPU, stall the engine, ...)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--control", default=None, metavar="SOCKET",
                   help="the demo's control socket (default $GPUGUARD_SIM_SOCKET or /tmp/gpuguard-sim-<uid>.sock)")
    p.add_argument("--json", action="store_true", help="print the answer as JSON")
    s = p.add_subparsers(dest="sim_command", metavar="ACTION")
    s.add_parser("scenarios", help="the simulated hosts, one line each")
    s.add_parser("status", help="the simulated cards now")
    for name, helptext in (("lose", "the GPU falls off the bus"), ("return", "a lost GPU comes back"),
                           ("reset", "a GPU reset (stock settings)"), ("unwedge", "release wedged reads")):
        c = s.add_parser(name, help=helptext)
        c.add_argument("gpu")
        if name == "return":
            c.add_argument("--slot", default=None, metavar="PORT",
                           help="the empty slot's port address (scenario incident-spare-slot: 0000:00:03.2): "
                                "the card comes back there, at a new PCI address")
    c = s.add_parser("wedge", help="reads of one sysfs file of the GPU hang")
    c.add_argument("gpu")
    c.add_argument("file", help="file name under the card's device folder (gpu_busy_percent, power1_average, ...)")
    c = s.add_parser("load", help="pin a GPU's load (0..1) or 'auto'")
    c.add_argument("gpu")
    c.add_argument("level")
    c = s.add_parser("engine", help="the demo's simulated vLLM")
    c.add_argument("action", choices=("stall", "unstall", "slow", "hang", "die"))
    c.add_argument("--step-time", type=float, default=None, help="seconds per decode step for 'slow' (default 0.5)")
    c = s.add_parser("kmsg", help="inject a kernel log line")
    c.add_argument("text")
    c.add_argument("--gpu", default=None, help="the device the line is about (its DEVICE= key)")
    c.add_argument("--level", type=int, default=3, help="printk level (3 = err, 4 = warning, 6 = info)")
    p.set_defaults(func=cmd_sim, _parser=p)


def cmd_sim(args: argparse.Namespace) -> int:
    if args.sim_command is None:
        args._parser.print_help()
        return 2
    if args.sim_command == "scenarios":
        from gpuguard.sim.runner import SCENARIO_HELP, SCENARIOS

        width = max(len(n) for n in SCENARIOS)
        for name in sorted(SCENARIOS):
            print(f"{name:<{width}}  {SCENARIO_HELP.get(name, '')}")
        return 0
    from gpuguard.sim.control import ControlError, default_socket, send

    path = args.control or default_socket()

    def call(op: str, **kw):
        return send(path, op, **kw)

    try:
        try:
            info = call("demo")
        except ControlError:
            info = {}  # a host served without the demo's extras: addresses only
        names = info.get("gpus", {})

        def bdf(gpu: str) -> str:
            if gpu in names:
                return names[gpu]
            known = set(call("all_gpus")) | set(names.values())
            if gpu in known:
                return gpu
            raise ControlError(f"no GPU named {gpu!r}; known: {', '.join(sorted(names) or sorted(known))}")

        c = args.sim_command
        if c == "status":
            result = call("state")
            if not args.json:
                by_bdf = {v: k for k, v in names.items()}
                for b, g in result["gpus"].items():
                    state = "lost" if g["lost_stage"] else "present" if g["present"] else "absent"
                    print(f"{by_bdf.get(b, '-'):<10} {b}  {g['model']:<22} {state:<8} load {g['load']:.2f}  "
                          f"{g['power_w']:6.1f} W  sclk {g['sclk_mhz']} MHz  {g['junction_c']} °C")
                return 0
        elif c == "lose":
            result = call("lose_gpu", bdf=bdf(args.gpu), err="ENODEV")
        elif c == "return":
            result = call("return_gpu", bdf=bdf(args.gpu), **({"slot": args.slot} if args.slot else {}))
        elif c == "reset":
            result = call("reset_gpu", bdf=bdf(args.gpu))
        elif c == "wedge":
            result = call("block", bdf=bdf(args.gpu), file=args.file)
        elif c == "unwedge":
            result = call("unblock", bdf=bdf(args.gpu))
        elif c == "load":
            level = None if args.level == "auto" else float(args.level)
            if info:  # the demo: pinned against its load pattern
                result = call("load", bdf=bdf(args.gpu), level=level)
            elif level is None:
                raise ControlError("'auto' needs the demo's load pattern; this host has none: give a level 0..1")
            else:  # a host without the demo's load pattern: set it directly
                result = call("set_load", bdf=bdf(args.gpu), level=level)
        elif c == "engine":
            result = call("engine", action=args.action, step_time=args.step_time)
        elif c == "kmsg":
            result = call("kmsg", text=args.text, level=args.level, bdf=bdf(args.gpu) if args.gpu else None)
        else:  # pragma: no cover - argparse limits the choices
            raise ControlError(f"unknown action {c}")
    except FileNotFoundError:
        print(f"gpuguard sim: no control socket at {path}: is `gpuguard demo` running? (or pass --control)",
              file=sys.stderr)
        return 1
    except ConnectionRefusedError:
        print(f"gpuguard sim: nothing listens on {path} (a demo that stopped?)", file=sys.stderr)
        return 1
    except (ControlError, ValueError, OSError) as e:
        print(f"gpuguard sim: {e}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(result, sys.stdout, default=str)
        print()
    else:
        print(f"ok: {c} {getattr(args, 'gpu', '') or getattr(args, 'action', '') or ''}".rstrip())
    return 0
