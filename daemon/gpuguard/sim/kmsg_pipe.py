"""The simulated kernel log, delivered to a daemon as kernel records: a FIFO that stands in
for /dev/kmsg (`kernel.kmsg_path`), fed from the simulated host's KernelLog. The daemon's
own reader parses it (kernel/kmsg.py), so `device lost from bus!` from a simulated card
takes the same path — rules, policy, engine kill — as on a real host, without root and
without touching the machine's real /dev/kmsg.

/dev/kmsg hands out one record per read(); a pipe hands out whatever is in it. So one
record is written at a time, and the next only once the reader has drained the pipe
(FIONREAD == 0). Each record is stamped with the host's CLOCK_MONOTONIC at delivery (the
simulated clock starts at boot+5 s): the daemon turns that stamp into wall-clock time.
"""
from __future__ import annotations

import array
import errno
import fcntl
import logging
import os
import stat
import termios
import threading
import time

from gpuguard.sim.kmsg import KernelLog, KmsgRecord

log = logging.getLogger("gpuguard.sim.kmsg")


def record_bytes(rec: KmsgRecord, usec: int) -> bytes:
    line = f"{rec.priority},{rec.seq},{usec},-;{rec.text}\n"
    if rec.bdf:
        line += f" SUBSYSTEM=pci\n DEVICE=+pci:{rec.bdf}\n"
    return line.encode()


class KmsgPipe:
    def __init__(self, kernel_log: KernelLog, path: str, interval: float = 0.05) -> None:
        self.kernel_log = kernel_log
        self.path = path
        self.interval = interval
        self.delivered = 0
        self._last_seq = 0
        self._stop = threading.Event()
        self._fd: int | None = None
        self._thread = threading.Thread(target=self._run, name="sim-kmsg", daemon=True)

    def start(self) -> "KmsgPipe":
        try:
            if not stat.S_ISFIFO(os.stat(self.path).st_mode):
                raise OSError(errno.EEXIST, f"{self.path} exists and is not a FIFO")
        except FileNotFoundError:
            os.mkfifo(self.path, 0o600)
        # O_RDWR: the pipe always has a writer, so the daemon's reader neither blocks on
        # open nor sees end-of-file while nothing is logged.
        self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread.start()
        return self

    def _pending_bytes(self) -> int:
        buf = array.array("i", [0])
        fcntl.ioctl(self._fd, termios.FIONREAD, buf)
        return buf[0]

    def _run(self) -> None:
        while not self._stop.is_set():
            for rec in self.kernel_log.since(self._last_seq):
                while self._pending_bytes() and not self._stop.is_set():
                    time.sleep(0.005)  # the reader has not taken the previous record yet
                if self._stop.is_set():
                    return
                usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
                try:
                    os.write(self._fd, record_bytes(rec, usec))
                except OSError as e:
                    log.error("simulated kernel log: cannot write %s: %s", self.path, e.strerror)
                    return
                self._last_seq = rec.seq
                self.delivered += 1
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def kmsg_op(kernel_log: KernelLog):
    """The control op that prints one kernel line (`gpuguard sim kmsg`), as a driver would."""

    def kmsg(text: str, level: int = 3, bdf: str | None = None) -> dict:
        if not 0 <= int(level) <= 7:  # a printk level; anything else reads as user space
            raise ValueError(f"kernel log level {level} is not 0..7 (3 = err, 4 = warning, 6 = info)")
        if "\n" in text:
            raise ValueError("one kernel log line at a time (no newline in the text)")
        rec = kernel_log.add(int(level), text, bdf)
        return {"seq": rec.seq, "text": text}

    return kmsg
