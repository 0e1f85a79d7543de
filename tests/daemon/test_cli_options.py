"""The commands' options agree: one name and metavar for one thing (`--sysfs-root DIR`,
`-c/--config FILE`), every command has a description for `--help`, and the same facts
give the same verdict (no GPU: `pcie` and `doctor` both warn and exit 1)."""
from __future__ import annotations

import argparse

import pytest

from gpuguard.cli import build_parser, main
from gpuguard.sim.runner import build_scenario
from gpuguard.sim.tree import write_tree


def commands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def options(parser: argparse.ArgumentParser, name: str) -> list[argparse.Action]:
    return [a for a in parser._actions if name in a.option_strings]


@pytest.mark.parametrize("command", sorted(commands()))
def test_every_command_says_what_it_does_in_its_help(command):
    description = commands()[command].description
    assert description and len(description.split()) >= 5, f"`gpuguard {command} --help` has no description"


@pytest.mark.parametrize("command", sorted(commands()))
def test_one_spelling_for_the_tree_and_the_config(command):
    parser = commands()[command]
    for a in options(parser, "--sysfs-root"):
        assert a.metavar == "DIR", f"{command} --sysfs-root shows {a.metavar or a.dest.upper()}"
    for a in options(parser, "--config"):
        assert "-c" in a.option_strings, f"{command} has --config without -c"
        assert a.metavar == "FILE", f"{command} --config shows {a.metavar or a.dest.upper()}"


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "host"
    write_tree(build_scenario("incident"), str(root))
    return root


def test_apply_dry_run_without_a_config_names_the_option(tree, capsys):
    assert main(["apply", "--dry-run", "--sysfs-root", str(tree)]) == 2
    err = capsys.readouterr().err
    assert "no GPU has a profile assigned" in err and "--config" in err, err


def test_pcie_on_a_host_without_a_gpu_warns_and_exits_1_as_doctor_does(tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "sys/bus/pci/devices").mkdir(parents=True)
    assert main(["doctor", "--sysfs-root", str(empty)]) == 1
    assert "no GPU found" in capsys.readouterr().out
    assert main(["pcie", "--sysfs-root", str(empty)]) == 1
    assert "no GPU found" in capsys.readouterr().out
    assert main(["pcie", "--json", "--sysfs-root", str(empty)]) == 1


def test_doctor_reads_the_tree_its_config_names(tree, tmp_path, capsys):
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text(f"sysfs_root: {tree}\nstate_dir: {tmp_path / 'state'}\n")
    main(["doctor", "-c", str(cfg), "--json"])
    import json

    doc = json.loads(capsys.readouterr().out)
    assert not [f for f in doc["findings"] if "no GPU found" in f["what"]], doc
    assert {f["where"] for f in doc["findings"]} >= {"0000:05:00.0", "0000:08:00.0"}, doc
    # --sysfs-root still wins over the config's tree
    empty = tmp_path / "empty"
    (empty / "sys/bus/pci/devices").mkdir(parents=True)
    assert main(["doctor", "-c", str(cfg), "--sysfs-root", str(empty)]) == 1
    assert "no GPU found" in capsys.readouterr().out
