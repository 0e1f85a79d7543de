"""Zero-byte scan as the owner's `find` does it, and quarantine by rename (never delete)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

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


def test_a_cache_and_its_related_folders_are_one_set_under_one_stamp(tmp_path):
    from gpuguard.engines.caches import quarantine_set

    cache, triton = tmp_path / "torch_compile_cache", tmp_path / "triton"
    cache.mkdir()
    _make(cache)
    (triton / "k1").mkdir(parents=True)
    (triton / "k1" / "kernel.json").write_text("{}")
    target, related = quarantine_set(cache, [triton, tmp_path / "absent"], "restart loop", when=0)
    assert target.name == "torch_compile_cache.BROKEN-19700101T000000Z-restart-loop"
    assert related == [{"from": str(triton), "to": str(tmp_path / "triton.BROKEN-19700101T000000Z-restart-loop")},
                       {"from": str(tmp_path / "absent"), "absent": "yes"}]
    assert (tmp_path / "triton.BROKEN-19700101T000000Z-restart-loop" / "k1" / "kernel.json").read_text() == "{}"


def test_a_related_folder_that_cannot_move_puts_the_set_back(tmp_path):
    from gpuguard.engines.caches import quarantine_set

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "k.py").write_text("x")
    stale = tmp_path / "old.BROKEN-x"  # a folder the quarantine refuses to rename
    stale.mkdir()
    with pytest.raises(CacheError, match=r"related folder of .*already a quarantined folder.*nothing was moved"):
        quarantine_set(cache, [stale], "r", when=0)
    assert (cache / "k.py").read_text() == "x" and stale.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "old.BROKEN-x"]


def test_a_related_folder_nested_with_its_cache_is_refused_naming_the_key():
    from pydantic import ValidationError

    from gpuguard.engines.config import CacheFolder

    ok = CacheFolder.model_validate({"name": "torch", "path": "/c/torch", "related": ["/c/triton"]})
    assert ok.related == [Path("/c/triton")] and CacheFolder(name="x", path=Path("/c/x")).related == []
    for nested in ("/c/torch/triton", "/c", "/c/torch"):
        with pytest.raises(ValidationError, match=rf"caches\.torch\.related: {nested} is /c/torch or nested with it"):
            CacheFolder.model_validate({"name": "torch", "path": "/c/torch", "related": [nested]})


def test_a_quarantine_asked_by_name_moves_the_related_folders_and_audits_both(tmp_path):
    import asyncio

    from gpuguard.engines.config import EngineConfig
    from gpuguard.engines.watchdog import EngineWatchdog

    cache, triton = tmp_path / "torch_compile_cache", tmp_path / "triton"
    cache.mkdir()
    _make(cache)
    (triton / "k1").mkdir(parents=True)
    cfg = EngineConfig.model_validate({"name": "e", "kind": "vllm", "url": "http://127.0.0.1:1", "process": {"cmdline": "x"},
                                       "caches": [{"name": "torch", "path": str(cache), "related": [str(triton)]}]})
    audit: list = []
    wd = EngineWatchdog([cfg], audit.append, lambda ev: None)
    out = asyncio.run(wd.quarantine_asked("torch", "alice"))
    (moved,) = tmp_path.glob("triton.BROKEN-*")
    assert out["to"].endswith(moved.name.removeprefix("triton")) and not triton.exists() and (moved / "k1").is_dir()
    assert out["related"] == [{"from": str(triton), "to": str(moved)}] and out["zero_byte_files"] == 2
    (rec,) = audit
    assert rec["who"] == "alice" and rec["result"] == {"from": str(cache), "to": out["to"], "related": out["related"]}
