"""The simulated kernel log: the records the simulated amdgpu driver and PCI core print.

The real driver reports *why* it refused an OD write only in the kernel log (the write itself
just fails with EINVAL, amdgpu-od-protocol.md §1.2); the simulator keeps those records here,
in /dev/kmsg form, so the daemon (and tests) can read the reason next to the error.
"""
from __future__ import annotations

from dataclasses import dataclass

# printk levels as /dev/kmsg carries them in the first field.
KERN_ERR = 3
KERN_WARNING = 4
KERN_INFO = 6


@dataclass(frozen=True)
class KmsgRecord:
    """One kernel log record. `text` is what follows the `;` in /dev/kmsg."""

    seq: int
    usec: int
    priority: int
    text: str
    bdf: str | None = None

    def kmsg_line(self) -> str:
        """The record as a raw /dev/kmsg read returns it (header, text, device key)."""
        line = f"{self.priority},{self.seq},{self.usec},-;{self.text}\n"
        if self.bdf:
            line += f" SUBSYSTEM=pci\n DEVICE=+pci:{self.bdf}\n"
        return line


class KernelLog:
    """Append-only list of records with a monotonic sequence number and clock."""

    def __init__(self, start_usec: int = 5_000_000) -> None:
        self.records: list[KmsgRecord] = []
        self._seq = 1000
        self._usec = start_usec

    def advance(self, dt: float) -> None:
        self._usec += int(dt * 1_000_000)

    def add(self, priority: int, text: str, bdf: str | None = None) -> KmsgRecord:
        self._seq += 1
        self._usec += 1
        rec = KmsgRecord(self._seq, self._usec, priority, text, bdf)
        self.records.append(rec)
        return rec

    def dev(self, priority: int, driver: str, bdf: str, msg: str) -> KmsgRecord:
        """dev_err/dev_info style: `amdgpu 0000:05:00.0: <msg>`."""
        return self.add(priority, f"{driver} {bdf}: {msg}", bdf)

    def since(self, seq: int) -> list[KmsgRecord]:
        return [r for r in self.records if r.seq > seq]

    def __iter__(self):
        return iter(list(self.records))

    def __len__(self) -> int:
        return len(self.records)
