"""Why the kernel refused a write: amdgpu answers every refused `pp_od_clk_voltage`
write with EINVAL and prints the reason only to the kernel log (amdgpu-od-protocol §1.2:
`GfxclkFmax (%ld) must be within [%u, %u]!`, `Voltage offset ...`). This reads the
`/dev/kmsg` records that appeared after a mark and picks the ones about one PCI address.

`KmsgReasons` is the default `kernel_reason(bdf, since) -> str | None` callable; `since`
is the value its `mark()` returned just before the write. The file is opened through the
SysfsRoot-rooted path `dev/kmsg`, non-blocking, positioned at the end (a real /dev/kmsg
returns one record per read and EAGAIN when drained; a plain file or a simulator's log
returns several lines per read and EOF).
"""
from __future__ import annotations

import collections
import errno
import os
import re
import threading

from gpuguard.hw.sysfs import SysfsRoot

KMSG = "dev/kmsg"
_HEADER = re.compile(r"^(\d+),(\d+),(\d+),[^;]*;(.*)$")


class KmsgReasons:
    def __init__(self, root: SysfsRoot, keep: int = 2000) -> None:
        self.root = root
        self._fd: int | None = None
        self._opened = False
        self._records: collections.deque[tuple[int, str, str | None]] = collections.deque(maxlen=keep)
        self._last_seq = 0
        self._partial = ""
        self._lock = threading.Lock()
        self.error: str | None = None  # why the log cannot be read (shown next to errors)

    def _open(self) -> None:
        self._opened = True
        try:
            fd = os.open(self.root.path(KMSG), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            self.error = f"cannot read the kernel log {self.root.path(KMSG)}: {os.strerror(e.errno or errno.EIO)}"
            return
        try:
            os.lseek(fd, 0, os.SEEK_END)  # only what is logged from now on
        except OSError:
            pass
        self._fd = fd

    def _drain(self) -> None:
        if not self._opened:
            self._open()
        if self._fd is None:
            return
        chunks = []
        for _ in range(100_000):
            try:
                data = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EPIPE:  # records overwritten before we read them
                    continue
                self.error = f"reading the kernel log: {os.strerror(e.errno or errno.EIO)}"
                break
            if not data:
                break
            chunks.append(data.decode("utf-8", "replace"))
        if not chunks:
            return
        text = self._partial + "".join(chunks)
        lines = text.split("\n")
        self._partial = lines.pop()  # an unterminated tail waits for the next drain
        last: list | None = None
        for line in lines:
            m = _HEADER.match(line)
            if m:
                seq = int(m.group(2))
                last = [seq, m.group(4), None]
                self._records.append(last)  # type: ignore[arg-type]
                self._last_seq = max(self._last_seq, seq)
            elif line.startswith(" DEVICE=+pci:") and last is not None:
                last[2] = line.split(":", 1)[1].strip()

    def mark(self) -> int:
        """The sequence number of the newest record seen so far."""
        with self._lock:
            self._drain()
            return self._last_seq

    def __call__(self, bdf: str, since: int) -> str | None:
        """Records newer than `since` about `bdf` (by DEVICE= key or `amdgpu <bdf>:` text),
        joined with '; ', or None."""
        with self._lock:
            self._drain()
            hits = [text for seq, text, dev in self._records if seq > since and (dev == bdf or bdf in text)]
        return "; ".join(hits[-3:]) if hits else None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
