"""Compile caches (INCIDENTS §7): count zero-byte files the way the owner's test does
(`find CACHE -path '*BROKEN*' -prune -o -type f -size 0 ! -name '*.lock' -print`) and
quarantine a broken cache by renaming it `<name>.BROKEN-<UTC date>-<reason>`, with the
folders named `related:` (the Triton key folders of the same compile) as one set under the
same stamp. Nothing here ever deletes: the evidence is kept."""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


class CacheError(RuntimeError):
    pass


@dataclass(frozen=True)
class CacheScan:
    path: Path
    exists: bool
    zero_byte_files: int
    files: int
    examples: tuple[str, ...]  # a few zero-byte paths, relative, for the audit record
    error: str | None = None


def scan_zero_byte(path: Path, examples: int = 10) -> CacheScan:
    path = Path(path)
    if not path.is_dir():
        return CacheScan(path, False, 0, 0, (), None if not path.exists() else f"{path} is not a directory")
    zero = 0
    total = 0
    found: list[str] = []
    errors: list[str] = []

    def onerror(exc: OSError) -> None:
        errors.append(f"{exc.filename}: {exc.strerror}")

    for root, dirs, files in os.walk(path, onerror=onerror):
        # -path '*BROKEN*' -prune: an earlier quarantine inside the tree is not counted again.
        dirs[:] = [d for d in dirs if "BROKEN" not in d]
        for name in files:
            if "BROKEN" in name:
                continue
            full = os.path.join(root, name)
            try:
                st = os.lstat(full)
            except OSError as exc:
                errors.append(f"{full}: {exc.strerror}")
                continue
            if not _is_regular(st.st_mode):
                continue
            total += 1
            if st.st_size == 0 and not name.endswith(".lock"):
                zero += 1
                if len(found) < examples:
                    found.append(os.path.relpath(full, path))
    return CacheScan(path, True, zero, total, tuple(found), "; ".join(errors[:5]) or None)


def _is_regular(mode: int) -> bool:
    import stat
    return stat.S_ISREG(mode)


def quarantine_name(path: Path, reason: str, when: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if when is None else when))
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", reason).strip("-") or "unspecified"
    base = path.with_name(f"{path.name}.BROKEN-{stamp}-{slug}")
    candidate, n = base, 2
    while candidate.exists():
        candidate = base.with_name(f"{base.name}-{n}")
        n += 1
    return candidate


def quarantine(path: Path, reason: str, when: float | None = None) -> Path:
    """Rename the cache folder aside (same filesystem, atomic); returns the new path."""
    path = Path(path)
    if "BROKEN" in path.name:
        raise CacheError(f"{path} is already a quarantined folder; refusing to rename it again")
    if not path.is_dir():
        raise CacheError(f"cache {path} is not a directory; nothing to quarantine")
    target = quarantine_name(path, reason, when)
    try:
        os.rename(path, target)
    except OSError as exc:
        raise CacheError(f"cannot rename {path} -> {target}: {exc.strerror}; rename it by hand") from None
    return target


def quarantine_set(path: Path, related: Sequence[Path], reason: str,
                   when: float | None = None) -> tuple[Path, list[dict[str, str]]]:
    """Rename the cache and its related folders aside under one stamp, as one set: when a
    rename fails, those done are renamed back and CacheError says what failed. A related
    folder that does not exist is listed as absent (nothing of it to keep).
    -> (the cache's new path, [{"from", "to"} or {"from", "absent": "yes"} per related folder])."""
    when = time.time() if when is None else when
    target = quarantine(path, reason, when)
    done: list[tuple[Path, Path]] = [(Path(path), target)]
    out: list[dict[str, str]] = []
    for r in map(Path, related):
        if not r.exists():
            out.append({"from": str(r), "absent": "yes"})
            continue
        try:
            moved = quarantine(r, reason, when)
        except CacheError as exc:
            undone = _undo(done)
            raise CacheError(f"related folder of {path}: {exc}; " + (
                "nothing was moved" if not undone else "also could not move back: " + "; ".join(undone)
                + "; rename them by hand")) from None
        done.append((r, moved))
        out.append({"from": str(r), "to": str(moved)})
    return target, out


def _undo(done: list[tuple[Path, Path]]) -> list[str]:
    """Rename back what a failed set moved; -> what could not be."""
    failed = []
    for original, moved in reversed(done):
        try:
            os.rename(moved, original)
        except OSError as exc:
            failed.append(f"{moved} -> {original}: {exc.strerror}")
    return failed
