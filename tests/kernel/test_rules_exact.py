"""Exact outcomes of rule loading and matching: the address a match is about, its fields,
the rule it names, the literals the prefilter looks for, and the words of every refusal.
bench/mutation.sh found each of these unobserved by the family tests."""
from __future__ import annotations

import locale
import re
from importlib import resources
from types import MappingProxyType

import pytest

from gpuguard.kernel.rules import Rules, RulesError, required_literals


@pytest.fixture(scope="module")
def rules() -> Rules:
    return Rules.load()


def _builtin_line(kind: str) -> int:
    """The line of the built-in rules.yaml where the first rule of `kind` starts."""
    text = resources.files("gpuguard.kernel").joinpath("rules.yaml").read_text("utf-8")
    for n, line in enumerate(text.splitlines(), 1):
        if re.match(rf"\s*-\s+kind:\s+{kind}\s*$", line):
            return n
    raise AssertionError(f"no rule of kind {kind} in rules.yaml")


# ------------------------------------------------------------------ the prefilter's literals


@pytest.mark.parametrize("pattern,literals", [
    (r"ring \S+ timeout", (" timeout",)),  # the longest run wins
    (r"abc\d", ("abc",)),  # three characters are enough
    (r"ab\d", None),  # two are not
    (r"abcd\dwxyz", ("abcd",)),  # a tie keeps the first
    (r"x(abcd)\d", ("abcd",)),  # inside a group
    (r"x(?i:abcd)\d", None),  # ... not a case-blind one
    (r"(?i)abcdef", None),
    (r"(?:alpha|beta)\d", ("alpha", "beta")),  # one of the branches' literals
    (r"abcd(?:x|\d)efghi", ("efghi",)),  # a branch without literals is skipped, not fatal
    (r"(?:abcd)+", ("abcd",)),  # repeated at least once: required
    (r"(?:abcd)++", ("abcd",)),  # possessive
    (r"(?:abcd)*x", None),  # maybe never: not required
    (r"(?:abcd){2,}x", ("abcd",)),
    (r"(", None),  # not a regex: no prefilter (the rule's own check refuses it)
])
def test_required_literals(pattern, literals):
    assert required_literals(pattern) == literals


def test_every_builtin_rule_that_can_have_literals_has_them(rules):
    assert [r.kind for r in rules.rules if r.needles is None] == []
    bar = next(r for r in rules.rules if r.kind == "bar_size")
    assert bar.needles == ("Detected VRAM RAM=", "Not enough PCI address space for a large BAR")


# ------------------------------------------------------------------ what a match carries


def test_a_match_names_its_rule_file_and_line(rules, tmp_path):
    m = rules.classify("[drm] Detected VRAM RAM=24560M, BAR=256M")
    assert m.rule == f"builtin rules.yaml:{_builtin_line('bar_size')}"
    f = tmp_path / "extra.yaml"
    f.write_text("rules:\n  - kind: none\n    pattern: 'x'\n  - kind: lab_note\n    pattern: 'lab card \\d+'\n")
    m = Rules.load(extra_file=f).classify("lab card 7 says hello")
    assert (m.kind, m.rule) == ("lab_note", f"{f}:4")


def test_match_fields_are_read_only(rules):
    m = rules.classify("[drm] Detected VRAM RAM=24560M, BAR=256M")
    assert isinstance(m.fields, MappingProxyType)
    with pytest.raises(TypeError):
        m.fields["large_bar"] = True  # type: ignore[index]


def test_address_and_xid_groups_are_not_fields(rules):
    m = rules.classify("NVRM: Xid (PCI:0000:86:00): 79, GPU has fallen off the bus.")
    assert (m.bdf, m.xid, dict(m.fields)) == ("0000:86:00.0", 79, {})
    m = rules.classify("NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.")
    assert (m.kind, m.bdf, dict(m.fields)) == ("device_lost", "0000:3b:00.0", {})


def test_the_nvrm_pci_group_names_the_gpu_whatever_address_comes_first(rules):
    m = rules.classify("nvidia 0000:3b:00.0: NVRM: Xid (PCI:0000:86:00): 79, GPU has fallen off the bus.")
    assert (m.bdf, m.bdf_all) == ("0000:86:00.0", ("0000:3b:00.0", "0000:86:00.0"))


def test_a_rules_bdf_group_names_the_gpu_whatever_address_comes_first(tmp_path):
    f = tmp_path / "extra.yaml"
    f.write_text("rules:\n  - kind: peer_lost\n    pattern: 'peer (?P<bdf>[0-9a-f:.]+) lost'\n")
    m = Rules.load(builtin=False, extra_file=f).classify("amdgpu 0000:03:00.0: peer 0000:04:00.0 lost")
    assert (m.bdf, m.bdf_all, dict(m.fields)) == ("0000:04:00.0", ("0000:03:00.0", "0000:04:00.0"), {})


def test_large_bar_is_judged_only_for_bar_size_with_both_figures(tmp_path):
    f = tmp_path / "extra.yaml"
    f.write_text("rules:\n"
                 "  - kind: bar_window\n    pattern: 'window (?P<bar_mib>\\d+)M of (?P<vram_mib>\\d+)M'\n"
                 "  - kind: bar_size\n    pattern: 'only BAR=(?P<bar_mib>\\d+)M'\n")
    r = Rules.load(builtin=False, extra_file=f)
    assert dict(r.classify("window 256M of 24560M").fields) == {"bar_mib": 256, "vram_mib": 24560}
    assert dict(r.classify("only BAR=256M").fields) == {"bar_mib": 256}


# ------------------------------------------------------------------ loading: exact refusals


def test_unreadable_file_says_what_to_fix(tmp_path):
    f = tmp_path / "nope.yaml"
    with pytest.raises(RulesError) as e:
        Rules.load(extra_file=f)
    assert str(e.value) == (f"kernel rules file {f}: cannot read it (No such file or directory); "
                            "fix kernel.rules_file or create the file")


def test_file_that_is_not_utf8_is_refused_by_name(tmp_path):
    f = tmp_path / "extra.yaml"
    f.write_bytes(b"rules:\n  - kind: k\n    pattern: 'temp\xe9rature'\n")
    with pytest.raises(RulesError) as e:
        Rules.load(extra_file=f)
    assert str(e.value) == (f"kernel rules file {f}: not UTF-8 text ('utf-8' codec can't decode byte 0xe9 "
                            "in position 37: invalid continuation byte)")


@pytest.fixture
def ascii_locale():
    """The C locale's ASCII as Python's default text encoding (a host without a UTF-8
    locale); skipped where Python runs in UTF-8 mode, which ignores the locale."""
    import sys

    if sys.flags.utf8_mode:
        pytest.skip("Python's UTF-8 mode ignores the locale")
    old = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        if locale.getpreferredencoding(False).lower() in ("utf-8", "utf8"):
            pytest.skip("the C locale is UTF-8 here")
        yield
    finally:
        locale.setlocale(locale.LC_CTYPE, old)


def test_rule_files_are_utf8_whatever_the_locale(tmp_path, ascii_locale):
    f = tmp_path / "extra.yaml"
    f.write_text("rules:\n  - kind: hot\n    pattern: 'température (?P<celsius>\\d+) °C'\n", encoding="utf-8")
    m = Rules.load(extra_file=f).classify("carte: température 97 °C")  # the built-in file is UTF-8 too
    assert (m.kind, dict(m.fields)) == ("hot", {"celsius": 97})


@pytest.mark.parametrize("body", ["rules: not a list\n", "rules: []\nextra: 1\n", "- kind: k\n  pattern: x\n"])
def test_top_level_must_be_exactly_a_rules_list(tmp_path, body):
    f = tmp_path / "extra.yaml"
    f.write_text(body)
    with pytest.raises(RulesError) as e:
        Rules.load(extra_file=f)
    assert str(e.value) == (f"kernel rules file {f}: expected one top-level key `rules:` holding a list of "
                            "rules (kind, pattern, severity, type, clears)")


def test_rule_that_is_not_a_mapping(tmp_path):
    f = tmp_path / "extra.yaml"
    f.write_text("rules:\n  - kind: k\n    pattern: x\n  - just a string\n")
    with pytest.raises(RulesError) as e:
        Rules.load(extra_file=f)
    assert str(e.value) == f"kernel rules file {f}:4: rule 1 is not a mapping"


def test_every_problem_of_a_rule_is_named_with_its_key(tmp_path):
    f = tmp_path / "extra.yaml"
    f.write_text("rules:\n  - kind: k\n    pattern: x\n    severity: loud\n    clears: [a, 1]\n")
    with pytest.raises(RulesError) as e:
        Rules.load(extra_file=f)
    assert str(e.value) == (f"kernel rules file {f}:2: rule 0 (kind 'k'): severity: Input should be 'info', "
                            "'warning', 'alert' or 'critical'; clears.1: Input should be a valid string")


@pytest.mark.parametrize("body", [
    "<<: {rules: [{kind: lab_note, pattern: 'lab card'}]}\n",
    "<<: [{rules: [{kind: lab_note, pattern: 'lab card'}]}]\n",
])
def test_rules_given_through_a_merge_key_load_at_an_unknown_line(tmp_path, body):
    """YAML merge keys are valid: the rules load; their lines cannot be told (0)."""
    f = tmp_path / "extra.yaml"
    f.write_text(body)
    m = Rules.load(builtin=False, extra_file=f).classify("lab card 7")
    assert (m.kind, m.rule) == ("lab_note", f"{f}:0")
