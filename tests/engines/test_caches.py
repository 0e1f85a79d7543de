"""Zero-byte scan as the owner's `find` does it, and quarantine by rename (never delete)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from gpuguard.engines.caches import CacheError, quarantine, scan_zero_byte


def _make(root):
    (root / "a" / "inductor_cache").mkdir(parents=True)
    (root / "a" / "inductor_cache" / "k1.py").touch()
    (root / "a" / "inductor_cache" / "k2.best_config").touch()
    (root / "a" / "inductor_cache" / "k3.py").write_text("ok")
    (root / "a" / "x.lock").touch()  # locks are legitimately empty
    (root / "old.BROKEN-20250101T000000Z-x").mkdir()
    (root / "old.BROKEN-20250101T000000Z-x" / "z.py").touch()  # pruned
    os.symlink("k1.py", root / "a" / "inductor_cache" / "link.py")  # not a regular file


def test_scan_matches_find(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    _make(root)
    scan = scan_zero_byte(root)
    assert scan.exists and scan.zero_byte_files == 2 and scan.files == 4
    assert sorted(scan.examples) == ["a/inductor_cache/k1.py", "a/inductor_cache/k2.best_config"]
    if shutil.which("find"):
        out = subprocess.run(["find", str(root), "-path", "*BROKEN*", "-prune", "-o", "-type", "f", "-size", "0",
                              "!", "-name", "*.lock", "-print"], capture_output=True, text=True, check=True)
        assert len(out.stdout.split()) == scan.zero_byte_files


def test_scan_absent_is_not_zero(tmp_path):
    scan = scan_zero_byte(tmp_path / "nope")
    assert not scan.exists and scan.error is None
    f = tmp_path / "file"
    f.write_text("x")
    assert "not a directory" in scan_zero_byte(f).error


def test_quarantine_renames_and_keeps_everything(tmp_path):
    root = tmp_path / "torch_compile_cache"
    root.mkdir()
    _make(root)
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    target = quarantine(root, "restart loop: zero-byte!", when=0)
    assert target.name == "torch_compile_cache.BROKEN-19700101T000000Z-restart-loop-zero-byte"
    assert not root.exists()
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == before
    root.mkdir()
    again = quarantine(root, "restart loop: zero-byte!", when=0)  # same second: no clobbering
    assert again.name.endswith("-2") and target.exists()


def test_quarantine_refuses_broken_and_missing(tmp_path):
    b = tmp_path / "c.BROKEN-x"
    b.mkdir()
    with pytest.raises(CacheError, match="already a quarantined"):
        quarantine(b, "r")
    with pytest.raises(CacheError, match="not a directory"):
        quarantine(tmp_path / "missing", "r")
