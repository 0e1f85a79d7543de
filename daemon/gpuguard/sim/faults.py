"""Fault injection on the simulated host (mixed into SimHost).

Owns the faults a daemon must survive, each with the kernel's observable behaviour:
- `lose_gpu(bdf)`: the GPU falls off the bus. First its SMU-backed reads fail (EIO, or the
  errno given), config space reads all ones, link status decodes as "Unknown"; on the next
  `step()` the board (GPU + its 1478/1479 bridges) is removed: directories and the
  drm/hwmon/bus symlinks vanish (new opens ENOENT, fds opened before ENODEV).
  Kernel log: "device lost from bus!", then "GPU Recovery Failed: -19" (INCIDENTS §1).
- `add_late_gpu(bdf, after_s)` / `appear(bdf)`: a GPU absent at start shows up later with
  all its links and the next free cardN/hwmonN (INCIDENTS §2, the glob that matched one card).
- `renumber_hwmon()`: every GPU's hwmonN changes (as between boots).
- `garbage(bdf, file, text)`: that file (by name, device or hwmon dir) reads `text`.
- `block(bdf, file)`: reads of that file hang until `unblock()`/`release_all()`.
- `block_writes(bdf, file)`: writes to that file hang the same way (an OD store() that
  never returns from the SMU).
- `return_gpu(bdf, slot=None)`: a GPU that fell off the bus is back (a slot power cycle, a bus
  rescan): a fresh driver instance at stock settings with the next free cardN/hwmonN. With
  `slot` (an empty root or switch downstream port with buses reserved for hotplug) the board
  comes back there instead, as when it is moved to another slot: the kernel enumerates it
  under that port, so it has new PCI addresses (bridges and GPU) and a new link, while its
  own identity files (vendor/device, subsystem ids, `unique_id`) are the card's, unchanged.
  The old slot is left empty.
- `suspend(bdf)` / `resume(bdf)`: runtime suspend (see amdgpu.py access gate).
- `reset_gpu(bdf, steps=0)`: stock OD values and default power cap, silently; PM files
  answer EPERM/EBUSY for `steps` steps while the reset is in progress.
- `ignore_first_write(bdf, kind)`: the next OD commit ("commit"), staging write ("stage")
  or power1_cap write ("power_cap") is accepted and silently not applied.
- `aer_error(bdf, name, count, severity)`: bump an AER counter.
"""
from __future__ import annotations

import errno
import threading

from dataclasses import replace

from .kmsg import KERN_ERR, KERN_INFO, KERN_WARNING
from .pcidev import AerCounters
from .topology import Card, RootComplex, _Enumerator


class FaultInjection:
    """Mixin: needs self.lock, self._gpus, self.kernel_log, self._rebuild, self.gpu."""

    def lose_gpu(self, bdf: str, err: int = errno.EIO, steps_before_removal: int = 1) -> None:
        with self.lock:
            g = self.gpu(bdf)
            g.faults.lost_stage = 1
            g.faults.lost_errno = err
            g.faults.removal_in = steps_before_removal
            self.kernel_log.add(KERN_ERR, f"amdgpu {g.bdf}: amdgpu: device lost from bus!", g.bdf)
            if steps_before_removal <= 0:
                self._remove(g)

    def _remove(self, g) -> None:
        g.faults.lost_stage = 2
        g.release_blocked()
        self.kernel_log.add(KERN_ERR, f"amdgpu {g.bdf}: amdgpu: GPU Recovery Failed: -19", g.bdf)
        self._rebuild()

    def _step_faults(self) -> bool:
        """Called by step() under the lock; True when the tree must be rebuilt."""
        changed = False
        for g in self._gpus.values():
            if g.faults.lost_stage == 1:
                g.faults.removal_in -= 1
                if g.faults.removal_in <= 0:
                    g.faults.lost_stage = 2
                    g.release_blocked()
                    self.kernel_log.add(KERN_ERR, f"amdgpu {g.bdf}: amdgpu: GPU Recovery Failed: -19", g.bdf)
                    changed = True
        due = [b for t, b in self.scheduled if t <= self.time]
        self.scheduled = [(t, b) for t, b in self.scheduled if t > self.time]
        for b in due:
            self._appear(self._gpus[b])
            changed = True
        return changed

    def add_late_gpu(self, bdf: str, after_s: float | None = None) -> None:
        """Take the GPU off the tree now; it appears after `after_s` simulated seconds
        (or when `appear()` is called)."""
        with self.lock:
            g = self.gpu(bdf)
            if g.present:
                g.present = False
                self._rebuild()
            if after_s is not None:
                self.scheduled.append((self.time + after_s, g.bdf))

    def appear(self, bdf: str) -> None:
        with self.lock:
            g = self.gpu(bdf)
            if not g.present:
                self._appear(g)
                self._rebuild()

    def _appear(self, g) -> None:
        if g.present:
            return
        g.card_index = self._next_free("card_index", self.spec.first_card)
        g.hwmon_index = self._next_free("hwmon_index", self.spec.cpu_hwmons)
        g.present = True
        self._log_appear(g)

    def renumber_hwmon(self) -> dict[str, int]:
        """New hwmonN for every present GPU (higher numbers, reversed order)."""
        with self.lock:
            present = [g for g in self._gpus.values() if g.present and g.faults.lost_stage < 2]
            base = max([g.hwmon_index or 0 for g in self._gpus.values()] + [self.spec.cpu_hwmons]) + 1
            for i, g in enumerate(reversed(present)):
                g.hwmon_index = base + i
            self._rebuild()
            return {g.bdf: g.hwmon_index for g in present}

    def garbage(self, bdf: str, file: str, text: str | bytes) -> None:
        with self.lock:
            data = text.encode() if isinstance(text, str) else text
            self.gpu(bdf).faults.garbage[file.rsplit("/", 1)[-1]] = data

    def clear_garbage(self, bdf: str, file: str | None = None) -> None:
        with self.lock:
            f = self.gpu(bdf).faults.garbage
            f.clear() if file is None else f.pop(file.rsplit("/", 1)[-1], None)

    def block(self, bdf: str, file: str) -> threading.Event:
        """Reads of `file` hang until the returned event is set (or unblock())."""
        with self.lock:
            ev = threading.Event()
            self.gpu(bdf).faults.blocked[file.rsplit("/", 1)[-1]] = ev
            return ev

    def block_writes(self, bdf: str, file: str) -> threading.Event:
        """Writes to `file` hang until the returned event is set (or unblock())."""
        with self.lock:
            ev = threading.Event()
            self.gpu(bdf).faults.blocked_writes[file.rsplit("/", 1)[-1]] = ev
            return ev

    def unblock(self, bdf: str, file: str | None = None) -> None:
        with self.lock:
            f = self.gpu(bdf).faults
            for blocked in (f.blocked, f.blocked_writes):
                names = list(blocked) if file is None else [file.rsplit("/", 1)[-1]]
                for n in names:
                    ev = blocked.pop(n, None)
                    if ev:
                        ev.set()

    def return_gpu(self, bdf: str, slot: str | None = None) -> str:
        """A GPU lost from the bus (or taken off by add_late_gpu) is back, at stock settings, as
        after a cold power-cycle: a new cardN/hwmonN, the driver's init line in the kernel log.
        `slot`: it comes back below that empty port (another address). Returns its address."""
        with self.lock:
            g = self.gpu(bdf)
            if g.present and g.faults.lost_stage == 0:
                if slot is not None:
                    raise ValueError(f"GPU {g.bdf} is on the bus: lose it first (lose_gpu or add_late_gpu)")
                return g.bdf
            if slot is not None:
                g.release_blocked()  # a read still hanging in the old slot ends (ENODEV)
                self._move_board(g, self._norm(slot))
            g.faults.lost_stage = 0
            g.faults.removal_in = 1
            g.present = False
            g.od.reset()
            g.power_cap_w = g.enforced_cap_w = g.model.power_default_w
            g.perf_level = "auto"
            g.dpm_masks.clear()
            self._appear(g)
            self._rebuild()
            return g.bdf

    def _move_board(self, g, slot: str) -> None:
        """Re-enumerate g's board (1478, 1479, GPU) below the empty port `slot`, the way
        pciehp does on a hot-add: buses from the port's reserved range, depth first."""
        port = self.by_bdf.get(slot)
        if port is None or port.kind not in ("root_port", "switch_down") or port.virtual:
            raise ValueError(f"no slot port at {slot}: give an empty root port or switch downstream port")
        if any(f.parent == slot for f in self.functions):
            raise ValueError(f"slot {slot} is not empty")
        sec, sub = port.secondary, port.subordinate
        if sec is None or sub is None or sub - sec + 1 < 3:
            raise ValueError(f"slot {slot} has buses {sec}-{sub}: a card needs 3 "
                             "(the kernel: 'No bus number available for hot-added bridge')")
        down = self.by_bdf[g.fn.parent]
        up = self.by_bdf[down.parent]
        old = {up.bdf, down.bdf, g.bdf}
        e = _Enumerator()
        e.gpu_index = [f.bdf for f in self.functions if f.is_gpu].index(g.bdf)  # its BAR windows
        rc = RootComplex(bus=int(slot.split(":")[1], 16), numa=port.numa, ports=(), domain=int(slot.split(":")[0], 16))
        # the slot link trains anew: the old slot's trained-down hop stays with the old slot
        card = replace(up.card, slot_speed=None, slot_width=None, present=True) if up.card else None
        e.card(card or Card(model=g.model), rc, sec, port.path, port, sec + 1)
        new = e.functions
        self.functions = [f for f in self.functions if f.bdf not in old]
        at = self.functions.index(port) + 1
        self.functions[at:at] = new
        self.by_bdf = {f.bdf: f for f in self.functions}
        for b in old:
            self.aer.pop(b, None)
        for f in new:
            self.aer[f.bdf] = AerCounters()
        old_bdf = g.bdf
        g.fn = new[-1]
        g.bdf = g.fn.bdf
        by_new = {(g.bdf if b == old_bdf else b): x for b, x in self._gpus.items()}
        self._gpus = {f.bdf: by_new[f.bdf] for f in self.functions if f.is_gpu}  # PCI order
        self.scheduled = [(t, g.bdf if b == old_bdf else b) for t, b in self.scheduled]
        self._link_view(g)
        self.kernel_log.add(KERN_INFO, f"pcieport {slot}: pciehp: Slot({int(port.bdf.split(':')[2][:2], 16)}): Card present", slot)
        self.kernel_log.add(KERN_INFO, f"pci {g.bdf}: [{g.fn.vendor:04x}:{g.fn.device:04x}] type 00 class "
                            f"0x{g.fn.class_code:06x} PCIe Legacy Endpoint", g.bdf)

    def release_all(self) -> None:
        """Release every blocked read (used on unmount/shutdown)."""
        with self.lock:
            for g in self._gpus.values():
                for ev in (*g.faults.blocked.values(), *g.faults.blocked_writes.values()):
                    ev.set()
                g.faults.blocked.clear()
                g.faults.blocked_writes.clear()

    def suspend(self, bdf: str, resume_error: int | None = None) -> bool:
        """Runtime-suspend the GPU (only possible while power/control is `auto`)."""
        with self.lock:
            g = self.gpu(bdf)
            g.faults.resume_error = resume_error
            if g.runtime_control != "auto":
                return False
            g.suspended = True
            return True

    def resume(self, bdf: str) -> None:
        with self.lock:
            g = self.gpu(bdf)
            g.suspended = False
            g.faults.resume_error = None

    def reset_gpu(self, bdf: str, steps: int = 0) -> None:
        with self.lock:
            self.gpu(bdf).reset(steps)

    def transients(self, bdf: str, scale: float = 1.0) -> None:
        """Scale the load model's power transients on one GPU: 0 = a flat load, 1 = the
        calibrated card (INCIDENTS §2), 2 = a spikier workload or card."""
        if not 0 <= float(scale) <= 10:
            raise ValueError(f"transients scale must be within 0..10, not {scale!r}")
        with self.lock:
            self.gpu(bdf).load_model.transient_scale = float(scale)

    def ignore_first_write(self, bdf: str, kind: str = "commit") -> None:
        if kind not in ("commit", "stage", "power_cap"):
            raise ValueError(f"ignore_first_write kind must be commit, stage or power_cap, not {kind!r}")
        with self.lock:
            self.gpu(bdf).faults.ignore_next.add(kind)

    def aer_error(self, bdf: str, name: str = "RxErr", count: int = 1, severity: str = "correctable") -> None:
        with self.lock:
            c = self.aer[self._norm(bdf)]
            table = {"correctable": c.cor, "nonfatal": c.nonfatal, "fatal": c.fatal}[severity]
            if name not in table:
                raise KeyError(f"unknown AER {severity} error {name!r}; known: {', '.join(table)}")
            table[name] += count
            kind = "Corrected" if severity == "correctable" else "Uncorrected"
            self.kernel_log.add(KERN_WARNING, f"pcieport {self._norm(bdf)}: AER: {kind} error message received from {self._norm(bdf)}", self._norm(bdf))
