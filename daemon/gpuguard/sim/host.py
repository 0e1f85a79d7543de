"""`SimHost`: the simulated host as a sysfs-like tree that answers like the kernel.

Owns: building the tree from the topology (`/sys/devices/pci0000:BB/...`, `/sys/bus/pci`,
`/sys/class/drm`, `/sys/class/hwmon`, `/sys/module/amdgpu/parameters`), path lookup with
symlinks, and the file operations `read` / `write` / `readdir` / `getattr` / `readlink`
that raise `OSError(errno)` where the kernel would (ENOENT, ENOTDIR, EISDIR, EACCES for a
read-only attribute or a non-root writer, plus whatever the driver returns: EINVAL,
ERANGE, EPERM/EBUSY, EIO, ENODEV). Files are rendered on read from the model state.
Fault injection lives in faults.py (mixed in), the driver in amdgpu.py, the load model in
load.py. Thread-safe: one lock; a blocked read waits outside it.

Simplifications: `config` is served whole to every reader (the kernel gives non-root
readers only the first 64 bytes); links do not retrain (no PCIe ASPM/DPM speed changes).
"""
from __future__ import annotations

import errno
import posixpath
import threading
from dataclasses import dataclass, field

from .amdgpu import AmdGpu, FileDef, oserror
from .cards import ERAS
from .faults import FaultInjection
from .kmsg import KERN_INFO, KernelLog
from .pcidev import AerCounters, pci_attributes
from .topology import HostSpec, PciFunction, enumerate_host, incident_spec


@dataclass
class Node:
    kind: str                              # "dir" | "file" | "link"
    mode: int = 0o755
    target: str = ""                       # link: relative target as readlink() returns it
    filedef: FileDef | None = None
    gpu: AmdGpu | None = None
    name: str = ""
    children: list = field(default_factory=list)


@dataclass(frozen=True)
class Stat:
    kind: str
    mode: int
    size: int
    target: str = ""


class SimHost(FaultInjection):
    """A simulated host. Build the incident host with `SimHost.incident()`."""

    def __init__(self, spec: HostSpec | None = None, seed: int = 0) -> None:
        self.spec = spec or incident_spec()
        self.seed = seed
        self.lock = threading.RLock()
        self.kernel_log = KernelLog()
        self.time = 0.0
        self.steps = 0
        self.version = 0                   # bumped on every structural change
        self.functions: list[PciFunction] = enumerate_host(self.spec)
        self.by_bdf = {f.bdf: f for f in self.functions}
        self.aer = {f.bdf: AerCounters() for f in self.functions}
        self.ppfeaturemask = self.spec.ppfeaturemask
        od_enabled = bool(self.ppfeaturemask & 0x4000)
        self._gpus: dict[str, AmdGpu] = {}
        for i, f in enumerate(x for x in self.functions if x.is_gpu):
            era = ERAS[(f.card.era if f.card and f.card.era else None) or self.spec.era]
            g = AmdGpu(f, era, self.kernel_log, od_enabled, seed=seed * 1000 + i)
            g.present = bool(f.card.present) if f.card else True
            self._link_view(g)
            self._gpus[f.bdf] = g
        self._assign_indices()
        self.scheduled: list[tuple[float, str]] = []   # (time, bdf) late appearances
        self.nodes: dict[str, Node] = {}
        self._rebuild()

    @classmethod
    def incident(cls, seed: int = 0, **variant) -> "SimHost":
        """The host of INCIDENTS §4; `variant` goes to topology.incident_spec()."""
        return cls(incident_spec(**variant), seed=seed)

    # -- model access -----------------------------------------------------------------
    @property
    def gpus(self) -> list[str]:
        """PCI addresses of the GPUs currently on the bus, in PCI order."""
        with self.lock:
            return [b for b, g in self._gpus.items() if g.present and g.faults.lost_stage < 2]

    @property
    def all_gpus(self) -> list[str]:
        return list(self._gpus)

    def gpu(self, bdf: str) -> AmdGpu:
        try:
            return self._gpus[self._norm(bdf)]
        except KeyError:
            raise KeyError(f"no simulated GPU at {bdf}; GPUs: {', '.join(self._gpus)}") from None

    @staticmethod
    def _norm(bdf: str) -> str:
        return bdf if bdf.count(":") == 2 else f"0000:{bdf}"

    def device_path(self, bdf: str) -> str:
        return self.by_bdf[self._norm(bdf)].path

    def card_path(self, bdf: str) -> str:
        return f"/sys/class/drm/card{self.gpu(bdf).card_index}"

    def hwmon_path(self, bdf: str) -> str:
        g = self.gpu(bdf)
        return f"{g.fn.path}/hwmon/hwmon{g.hwmon_index}"

    def set_load(self, bdf: str, level: float) -> None:
        with self.lock:
            self.gpu(bdf).load_level = min(1.0, max(0.0, float(level)))

    def set_vram(self, bdf: str, used_bytes: int) -> None:
        with self.lock:
            g = self.gpu(bdf)
            g.vram_used = max(0, min(int(used_bytes), g.model.vram_total))

    def step(self, dt: float) -> None:
        """Advance simulated time by dt seconds: sensors, resets, losses, late GPUs."""
        with self.lock:
            self.time += dt
            self.steps += 1
            self.kernel_log.advance(dt)
            changed = self._step_faults()
            for g in self._gpus.values():
                if g.present and g.faults.lost_stage == 0:
                    g.step(dt)
            if changed:
                self._rebuild()

    # -- indices ----------------------------------------------------------------------
    def _link_view(self, g: AmdGpu) -> None:
        """What the SMU sees of the slot link: the card's upstream bridge, and the
        capability of the first non-card port above it (amdgpu partner bandwidth)."""
        up = self.by_bdf_fn(g.fn.parent)
        card_up = self.by_bdf_fn(up.parent) if up else None
        partner = self.by_bdf_fn(card_up.parent) if card_up else None
        if card_up:
            g.slot_link = (card_up.cur_speed, card_up.cur_width)
        if partner:
            g.pcie_cap = partner.max_speed

    def by_bdf_fn(self, bdf: str | None) -> PciFunction | None:
        return self.by_bdf.get(bdf) if bdf else None

    def _assign_indices(self) -> None:
        present = [b for b, g in self._gpus.items() if g.present]
        order = [b for b in (self.spec.card_order or reversed(list(self._gpus))) if b in present]
        order += [b for b in present if b not in order]
        for i, b in enumerate(order):
            self._gpus[b].card_index = self.spec.first_card + i
        hw = [b for b in (self.spec.hwmon_order or (present[1:] + present[:1])) if b in present]
        hw += [b for b in present if b not in hw]
        for i, b in enumerate(hw):
            self._gpus[b].hwmon_index = self.spec.cpu_hwmons + i

    def _next_free(self, attr: str, start: int) -> int:
        used = {getattr(g, attr) for g in self._gpus.values() if g.present and getattr(g, attr) is not None}
        n = start
        while n in used:
            n += 1
        return n

    # -- tree -------------------------------------------------------------------------
    def _rebuild(self) -> None:
        self.version += 1
        n: dict[str, Node] = {"/": Node("dir")}

        def mkdir(path: str) -> None:
            if path in n:
                return
            parent = posixpath.dirname(path)
            mkdir(parent)
            n[path] = Node("dir", name=posixpath.basename(path))
            n[parent].children.append(posixpath.basename(path))

        def add(path: str, node: Node) -> None:
            parent = posixpath.dirname(path)
            mkdir(parent)
            node.name = posixpath.basename(path)
            if path not in n:
                n[parent].children.append(node.name)
            n[path] = node

        def link(path: str, target_abs: str) -> None:
            add(path, Node("link", mode=0o777, target=posixpath.relpath(target_abs, posixpath.dirname(path))))

        def file(path: str, fd: FileDef, gpu: AmdGpu | None = None) -> None:
            add(path, Node("file", mode=fd.mode, filedef=fd, gpu=gpu))

        for d in ("/sys/bus/pci/drivers/amdgpu", "/sys/bus/pci/drivers/pcieport", "/sys/class/drm",
                  "/sys/class/hwmon", "/sys/bus/pci/devices"):
            mkdir(d)
        file("/sys/module/amdgpu/parameters/ppfeaturemask",
             FileDef(lambda: f"0x{self.ppfeaturemask:08x}\n".encode()))
        for k in range(self.spec.cpu_hwmons):
            hp = f"/sys/devices/platform/coretemp.{k}/hwmon/hwmon{k}"
            file(f"{hp}/name", FileDef(lambda: b"coretemp\n"))
            file(f"{hp}/temp1_input", FileDef(lambda k=k: f"{41000 + 3000 * k}\n".encode()))
            file(f"{hp}/temp1_label", FileDef(lambda k=k: f"Package id {k}\n".encode()))
            link(f"/sys/class/hwmon/hwmon{k}", hp)
        hidden = self._hidden_functions()
        for f in self.functions:
            if f.bdf in hidden:
                continue
            if f.parent is None:
                mkdir(posixpath.dirname(f.path))
            g = self._gpus.get(f.bdf)
            card_gpu = self._card_gpu(f)
            dead = (lambda cg=card_gpu: cg is not None and cg.faults.lost_stage >= 1)
            for name, render in pci_attributes(f, self.aer[f.bdf], dead).items():
                writable = name in ("config", "uevent")
                fd = FileDef(render, (lambda d: None) if writable else None)
                file(f"{f.path}/{name}", fd, card_gpu if name in ("config",) else None)
            if f.driver:
                link(f"{f.path}/driver", f"/sys/bus/pci/drivers/{f.driver}")
                link(f"/sys/bus/pci/drivers/{f.driver}/{f.bdf}", f.path)
            link(f"{f.path}/subsystem", "/sys/bus/pci")
            link(f"/sys/bus/pci/devices/{f.bdf}", f.path)
            if g is None:
                file(f"{f.path}/power/runtime_status", FileDef(lambda: b"active\n"))
                file(f"{f.path}/power/control", FileDef(lambda: b"on\n", lambda d: None))
                continue
            for name, fd in g.device_files().items():
                file(f"{f.path}/{name}", fd, g)
            cp = f"{f.path}/drm/card{g.card_index}"
            minor = g.card_index
            file(f"{cp}/dev", FileDef(lambda m=minor: f"226:{m}\n".encode()), g)
            file(f"{cp}/uevent", FileDef(lambda m=minor: f"MAJOR=226\nMINOR={m}\nDEVNAME=dri/card{m}\nDEVTYPE=drm_minor\n".encode(), lambda d: None), g)
            link(f"{cp}/device", f.path)
            link(f"/sys/class/drm/card{g.card_index}", cp)
            rnum = 128 + g.card_index - self.spec.first_card
            rp = f"{f.path}/drm/renderD{rnum}"
            file(f"{rp}/dev", FileDef(lambda r=rnum: f"226:{r}\n".encode()), g)
            link(f"{rp}/device", f.path)
            link(f"/sys/class/drm/renderD{rnum}", rp)
            hp = f"{f.path}/hwmon/hwmon{g.hwmon_index}"
            for name, fd in g.hwmon_files().items():
                file(f"{hp}/{name}", fd, g)
            link(f"{hp}/device", f.path)
            link(f"/sys/class/hwmon/hwmon{g.hwmon_index}", hp)
        self.nodes = n
        self._lookup_cache: dict = {}    # only successful lookups; cleared with the tree

    def _hidden_functions(self) -> set[str]:
        hidden = set()
        for g in self._gpus.values():
            if not g.present or g.faults.lost_stage >= 2:
                # The whole board leaves the bus: the card's bridges and the GPU.
                down = self.by_bdf_fn(g.fn.parent)
                hidden.update({g.bdf, down.bdf, down.parent} if down else {g.bdf})
        return hidden

    def _card_gpu(self, f: PciFunction) -> AmdGpu | None:
        if f.kind == "gpu":
            return self._gpus[f.bdf]
        if f.kind in ("card_up", "card_down"):
            for g in self._gpus.values():
                down = self.by_bdf_fn(g.fn.parent)
                if down and (down.bdf == f.bdf or down.parent == f.bdf):
                    return g
        return None

    # -- lookup -----------------------------------------------------------------------
    def _lookup(self, path: str, follow: bool = True) -> tuple[str, Node]:
        key = (path, follow)
        hit = self._lookup_cache.get(key)
        if hit is not None:
            return hit
        found = self._walk_path(path, follow)
        self._lookup_cache[key] = found
        return found

    def _walk_path(self, path: str, follow: bool) -> tuple[str, Node]:
        if not path.startswith("/"):
            path = "/" + path
        parts = [p for p in path.split("/") if p and p != "."]
        cur = "/"
        hops = 0
        i = 0
        while i < len(parts):
            part = parts[i]
            if part == "..":
                cur = posixpath.dirname(cur) or "/"
                i += 1
                continue
            node = self.nodes.get(cur)
            if node is None or node.kind != "dir":
                raise oserror(errno.ENOTDIR, path)
            nxt = posixpath.join(cur, part)
            child = self.nodes.get(nxt)
            if child is None:
                raise oserror(errno.ENOENT, path)
            last = i == len(parts) - 1
            if child.kind == "link" and (follow or not last):
                hops += 1
                if hops > 40:
                    raise oserror(errno.ELOOP, path)
                target = posixpath.normpath(posixpath.join(cur, child.target))
                parts = [p for p in target.split("/") if p] + parts[i + 1:]
                cur, i = "/", 0
                continue
            cur = nxt
            i += 1
        return cur, self.nodes[cur]

    def realpath(self, path: str) -> str:
        with self.lock:
            return self._lookup(path)[0]

    def exists(self, path: str) -> bool:
        try:
            with self.lock:
                self._lookup(path)
            return True
        except OSError:
            return False

    # -- file operations --------------------------------------------------------------
    def getattr(self, path: str, follow: bool = False) -> Stat:
        """lstat() by default (what FUSE asks for); `follow=True` for stat()."""
        with self.lock:
            _, node = self._lookup(path, follow=follow)
            if node.kind == "dir":
                return Stat("dir", 0o755, 0)
            if node.kind == "link":
                return Stat("link", 0o777, len(node.target), node.target)
            size = 4096
            return Stat("file", node.mode, size)

    def readdir(self, path: str) -> list[str]:
        with self.lock:
            _, node = self._lookup(path)
            if node.kind != "dir":
                raise oserror(errno.ENOTDIR, path)
            return list(node.children)

    def readlink(self, path: str) -> str:
        with self.lock:
            _, node = self._lookup(path, follow=False)
            if node.kind != "link":
                raise oserror(errno.EINVAL, path)
            return node.target

    def read(self, path: str, uid: int = 0) -> bytes:
        """The bytes one read() of the whole attribute returns (sysfs show())."""
        with self.lock:
            real, node = self._lookup(path)
            if node.kind == "dir":
                raise oserror(errno.EISDIR, path)
            g = node.gpu
            blocker = g.faults.blocked.get(node.name) if g else None
        if blocker is not None:
            blocker.wait()               # released by SimHost.release()/unblock()
        with self.lock:
            if real not in self.nodes:
                raise oserror(errno.ENODEV, path)   # removed while we waited (kernfs)
            if g is not None:
                g.check_read(node.filedef.gated)
                if node.name in g.faults.garbage:
                    return g.faults.garbage[node.name]
            return node.filedef.render()

    def write(self, path: str, data: bytes, uid: int = 0) -> int:
        """One write() of `data`; returns the byte count like a sysfs store()."""
        if isinstance(data, str):
            data = data.encode()
        with self.lock:
            _, node = self._lookup(path)
            g = node.gpu
            blocker = g.faults.blocked_writes.get(node.name) if g and node.kind == "file" else None
        if blocker is not None:
            blocker.wait()               # released by unblock()/release_all()
        with self.lock:
            _, node = self._lookup(path)
            if node.kind == "dir":
                raise oserror(errno.EISDIR, path)
            fd = node.filedef
            if fd.write is None:
                raise oserror(errno.EACCES, path)    # kernfs: no store() → open fails
            if uid != 0 and not fd.mode & 0o002:
                raise oserror(errno.EACCES, path)
            g = node.gpu
            if g is not None and node.name not in ("uevent", "control", "config"):
                g.check_write(node.name)
            fd.write(data)
            return len(data)

    def check_open(self, path: str, write: bool, uid: int = 0) -> None:
        """open() checks: existence, directory, write permission."""
        with self.lock:
            _, node = self._lookup(path)
            if node.kind == "dir" and write:
                raise oserror(errno.EISDIR, path)
            if write and node.kind == "file":
                if node.filedef.write is None or (uid != 0 and not node.mode & 0o002):
                    raise oserror(errno.EACCES, path)

    def walk(self) -> list[str]:
        """Every path in the tree (dirs, files, links), parents first."""
        with self.lock:
            return sorted(self.nodes)

    def kmsg_lines(self, since_seq: int = 0) -> list[str]:
        return [r.kmsg_line() for r in self.kernel_log.since(since_seq)]

    def state(self) -> dict:
        """A JSON-able summary (control channel, demo)."""
        with self.lock:
            out = {"time": self.time, "steps": self.steps, "gpus": {}}
            for b, g in self._gpus.items():
                s = g.sensors
                out["gpus"][b] = {
                    "model": g.model.name, "present": g.present, "lost_stage": g.faults.lost_stage,
                    "card": g.card_index, "hwmon": g.hwmon_index, "load": g.load_level,
                    "power_w": round(s.power_avg_w, 1), "sclk_mhz": s.sclk_mhz, "mclk_mhz": s.mclk_mhz,
                    "junction_c": round(s.temp_junction_c, 1), "cap_w": g.power_cap_w,
                    "enforced_cap_w": g.enforced_cap_w, "od_staged": g.od.staged, "od_active": g.od.active,
                    "suspended": g.suspended, "perf_level": g.perf_level,
                }
            return out

    def _log_appear(self, g: AmdGpu) -> None:
        self.kernel_log.add(KERN_INFO, f"[drm] Initialized amdgpu 3.61.0 for {g.bdf} on minor {g.card_index}", g.bdf)

