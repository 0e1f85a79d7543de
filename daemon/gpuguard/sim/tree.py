"""Write a SimHost to a plain directory (files + real symlinks) for users without FUSE or
root: `gpuguard demo --write-tree DIR`, `--sysfs-root DIR`.

    writer = write_tree(host, "/tmp/simroot")   # full tree now
    host.step(0.5); writer.refresh()             # after each step

`refresh()` (1) feeds writes a daemon made to writable files back through the model's
write path (`SimHost.write`), (2) re-renders every file and replaces the ones that changed
atomically (temp file + rename, so a reader never sees half a file), (3) creates and
removes directories and links as GPUs appear, vanish or renumber.

Limitations, by nature of a plain directory (use the FUSE mount for these):
- errno results are not the kernel's: a refused write just reverts the file on the next
  refresh (the reason is in host.kernel_log); a file whose read fails in the model
  (EIO, EPERM, ...) is removed, so readers see ENOENT; a blocked file keeps its
  last content instead of blocking.
- only the last write between two refreshes is seen, one command per file: several OD
  commands (`s`, `vo`, `c`) written in a burst need a refresh between them.
"""
from __future__ import annotations

import os
import shutil
import tempfile

from .host import SimHost


class TreeWriter:
    def __init__(self, host: SimHost, root: str) -> None:
        self.host = host
        self.root = os.path.abspath(root)
        self.written: dict[str, bytes] = {}     # host path → bytes last written to disk
        self.links: dict[str, str] = {}
        self.dirs: set[str] = set()

    def _disk(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _atomic_write(self, path: str, data: bytes, mode: int) -> None:
        disk = self._disk(path)
        d = os.path.dirname(disk)
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=d)
        try:
            os.write(fd, data)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(tmp, disk)

    def _pick_up_writes(self) -> None:
        for path, last in list(self.written.items()):
            node = self.host.nodes.get(path)
            if node is None or node.kind != "file" or node.filedef.write is None:
                continue
            try:
                with open(self._disk(path), "rb") as f:
                    now = f.read()
            except OSError:
                continue
            if now != last:
                try:
                    self.host.write(path, now)
                except OSError:
                    pass     # refused, as the kernel would; the reason is in the kernel log
                self.written[path] = b"\0invalid"   # force a re-render below

    def refresh(self) -> int:
        """Bring the directory in line with the model; returns the number of files written."""
        with self.host.lock:
            self._pick_up_writes()
            nodes = dict(self.host.nodes)
        count = 0
        want_dirs = {p for p, n in nodes.items() if n.kind == "dir"}
        want_links = {p: n.target for p, n in nodes.items() if n.kind == "link"}
        want_files = {p: n for p, n in nodes.items() if n.kind == "file"}
        # removals first (deepest first), so a vanished GPU disappears as a whole
        for p in sorted(set(self.written) - set(want_files), reverse=True):
            self._unlink(p)
            self.written.pop(p, None)
        for p in sorted(set(self.links) - set(want_links), reverse=True):
            self._unlink(p)
            self.links.pop(p, None)
        for p in sorted(self.dirs - want_dirs, reverse=True):
            shutil.rmtree(self._disk(p), ignore_errors=True)
            self.dirs.discard(p)
        for p in sorted(want_dirs - self.dirs):
            os.makedirs(self._disk(p), exist_ok=True)
            self.dirs.add(p)
        for p, target in want_links.items():
            if self.links.get(p) != target:
                self._unlink(p)
                os.symlink(target, self._disk(p))
                self.links[p] = target
        for p, node in want_files.items():
            if node.gpu is not None and node.name in node.gpu.faults.blocked:
                continue     # cannot block a plain file: keep its last content
            try:
                data = self.host.read(p)
            except OSError:
                data = None
            if data is None:
                if p in self.written:
                    self._unlink(p)
                    self.written.pop(p)
                continue
            if self.written.get(p) != data:
                self._atomic_write(p, data, node.mode)
                self.written[p] = data
                count += 1
        return count

    def _unlink(self, p: str) -> None:
        try:
            os.unlink(self._disk(p))
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            shutil.rmtree(self._disk(p), ignore_errors=True)


def write_tree(host: SimHost, root: str) -> TreeWriter:
    """Write the whole tree under `root` now; keep the returned writer to refresh it."""
    os.makedirs(root, exist_ok=True)
    writer = TreeWriter(host, root)
    writer.refresh()
    return writer


def main(argv: list[str] | None = None) -> int:
    import argparse
    import signal
    import sys
    import threading

    from .runner import SCENARIOS, SimRunner, build_scenario

    ap = argparse.ArgumentParser(prog="python -m gpuguard.sim.tree",
                                 description="Write the simulated host to DIR and keep it current.")
    ap.add_argument("dir")
    ap.add_argument("--scenario", default="incident", choices=sorted(SCENARIOS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-interval", type=float, default=0.5, help="0: write once and exit")
    ap.add_argument("--control", help="UNIX socket path for the control channel")
    args = ap.parse_args(argv)
    host = build_scenario(args.scenario, args.seed)
    writer = write_tree(host, args.dir)
    print(f"gpuguard.sim.tree: wrote {args.scenario} to {args.dir}", flush=True)
    if args.step_interval <= 0:
        return 0
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: done.set())
    signal.signal(signal.SIGINT, lambda *a: done.set())
    runner = SimRunner(host, interval=args.step_interval, control_socket=args.control, on_step=writer.refresh)
    runner.start()
    done.wait()
    runner.stop()
    print("gpuguard.sim.tree: stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
