"""Compile caches (INCIDENTS §7): count zero-byte files the way the owner's test does
(`find CACHE -path '*BROKEN*' -prune -o -type f -size 0 ! -name '*.lock' -print`) and
quarantine a broken cache by renaming it `<name>.BROKEN-<UTC date>-<reason>`. Nothing here
ever deletes: the evidence is kept."""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path


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
