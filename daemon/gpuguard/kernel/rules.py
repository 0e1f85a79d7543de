"""Kernel log rules: what a kernel message means. Owns the rule file format (YAML, like
node-problem-detector's kernel monitor), loading and validating it, PCI address
and `Rules.classify(text) -> Match | None` (PCI addresses: gpuguard.hw.pci_address).

A rule is a kind, a regex, a severity, and whether the kind is a one-off `event` or a
`condition` that holds (a GPU that fell off the bus stays lost) until cleared. Rules match
message text only (never the dictionary lines), after the kernel's `\\xNN` escaping was
undone. User rules come before the built-in ones so a user can override them; a user rule
of kind `none` marks a line as benign.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpuguard.hw.pci_address import addresses_in, normalise_bdf  # noqa: F401 (re-exported)


BUILTIN_KINDS = (
    "gpu_hang", "gpu_reset_start", "gpu_reset_ok", "gpu_reset_failed", "device_lost",
    "sq_interrupt", "vm_fault", "pcie_aer_corrected", "pcie_aer_uncorrected",
    "pcie_link_down", "p2p_unsupported", "bar_size", "thermal_throttle", "nvidia_xid",
    "oom_kill", "hung_task",
)
IGNORE_KIND = "none"

class RulesError(ValueError):
    """A rule file is missing, unreadable or invalid. The message names the file, the rule
    (index, line, kind) and the key, and says what to fix."""


class RuleSpec(BaseModel):
    """One rule as written in YAML."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    pattern: str
    severity: Literal["info", "warning", "alert", "critical"] = "warning"
    type: Literal["event", "condition"] = "event"
    clears: list[str] = Field(default_factory=list)
    description: str | None = None

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"invalid regex ({e}); YAML single quotes keep backslashes as written")
        return v


@dataclass(frozen=True)
class Rule:
    kind: str
    severity: str
    condition: bool
    regex: re.Pattern[str]
    clears: tuple[str, ...]
    origin: str  # "file:line" for error messages and `events classify --json`
    # Literal strings of which every match contains at least one (derived from the regex);
    # None when none could be derived. A substring test is ~50x cheaper than a regex
    # search, and almost every kernel line is benign: this keeps a flood cheap.
    needles: tuple[str, ...] | None = None


def required_literals(pattern: str) -> tuple[str, ...] | None:
    """Strings of which any match of `pattern` must contain one, or None if unknown."""
    try:
        from re import _parser as sre_parse  # the stdlib's own regex parser
        parsed = sre_parse.parse(pattern)
    except Exception:  # noqa: BLE001 - an optimisation only; the regex still decides
        return None
    if parsed.state.flags & re.IGNORECASE:
        return None
    found = _literals_of(list(parsed), sre_parse)
    return tuple(sorted(found)) if found else None


def _literals_of(items: list, sp) -> set[str] | None:
    c = sp  # opcode constants live on the parser module
    best: set[str] | None = None

    def better(cand: set[str] | None) -> None:
        nonlocal best
        if cand and min(map(len, cand)) >= 3 and (best is None or min(map(len, cand)) > min(map(len, best))):
            best = cand

    run = ""
    for op, arg in items:
        if op is c.LITERAL:
            run += chr(arg)
            continue
        better({run} if run else None)
        run = ""
        if op is c.SUBPATTERN:
            _group, add_flags, _del_flags, sub = arg
            if not add_flags & re.IGNORECASE:
                better(_literals_of(list(sub), sp))
        elif op is c.BRANCH:
            union: set[str] = set()
            for branch in arg[1]:
                lits = _literals_of(list(branch), sp)
                if not lits:
                    union = set()
                    break
                union |= lits
            better(union or None)
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)):
            lo, _hi, sub = arg
            if lo >= 1:
                better(_literals_of(list(sub), sp))
    better({run} if run else None)
    return best


@dataclass(frozen=True)
class Match:
    """A classified message. `bdf` is the address the line is about (the rule's `bdf` or
    NVRM `PCI:` group, else the first address in the text); `bdf_all` every address."""

    kind: str
    severity: str
    condition: bool
    bdf: str | None
    bdf_all: tuple[str, ...]
    xid: int | None
    clears: tuple[str, ...] = ()
    fields: Mapping[str, Any] = field(default_factory=dict)
    rule: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))


def _group_fields(m: re.Match[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in m.groupdict().items():
        if value is None or name in ("bdf", "nvrm_pci", "xid"):
            continue
        # Python's re allows each group name once; `peer_2` is a second spelling of `peer`.
        key = re.sub(r"_\d+$", "", name)
        out.setdefault(key, int(value) if re.fullmatch(r"-?\d+", value) else value)
    return out


class Rules:
    """An ordered rule list; the first rule whose regex is found in the text wins."""

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = list(rules)

    def __len__(self) -> int:
        return len(self.rules)

    @classmethod
    def load(cls, builtin: bool = True, extra_file: str | Path | None = None) -> "Rules":
        rules: list[Rule] = []
        if extra_file is not None:
            path = Path(extra_file)
            try:
                text = path.read_text(encoding="utf-8")
            except OSError as e:
                raise RulesError(f"kernel rules file {path}: cannot read it ({e.strerror}); "
                                 "fix kernel.rules_file or create the file") from None
            except UnicodeDecodeError as e:
                raise RulesError(f"kernel rules file {path}: not UTF-8 text ({e})") from None
            rules += parse_rules(text, str(path))
        if builtin:
            text = resources.files("gpuguard.kernel").joinpath("rules.yaml").read_text("utf-8")
            rules += parse_rules(text, "builtin rules.yaml")
        return cls(rules)

    def classify(self, text: str) -> Match | None:
        for rule in self.rules:
            if rule.needles is not None:
                for needle in rule.needles:  # a plain loop: any(genexpr) costs 3x here
                    if needle in text:
                        break
                else:
                    continue
            m = rule.regex.search(text)
            if m is None:
                continue
            if rule.kind == IGNORE_KIND:
                return None
            groups = m.groupdict()
            every = addresses_in(text)
            named = groups.get("bdf") or groups.get("nvrm_pci")
            bdf = normalise_bdf(named) if named else (every[0] if every else None)
            fields = _group_fields(m)
            if rule.kind == "bar_size" and "vram_mib" in fields and "bar_mib" in fields:
                # INCIDENTS §5: a 256 MB BAR on a 24 GB card means no large BAR, no P2P.
                fields["large_bar"] = fields["bar_mib"] >= fields["vram_mib"]
            xid = groups.get("xid")
            return Match(
                kind=rule.kind, severity=rule.severity, condition=rule.condition,
                bdf=bdf, bdf_all=tuple(every), xid=int(xid) if xid else None,
                clears=rule.clears, fields=fields, rule=rule.origin,
            )
        return None


def parse_rules(text: str, origin: str) -> list[Rule]:
    """Rules from YAML text (`rules:` list). Raises RulesError naming origin, rule and key."""
    try:
        doc = yaml.compose(text)
    except yaml.YAMLError as e:
        raise RulesError(f"kernel rules file {origin}: not valid YAML: {e}") from None
    if doc is None:
        return []
    data = yaml.safe_load(text)
    if not isinstance(data, dict) or set(data) != {"rules"} or not isinstance(data["rules"], list):
        raise RulesError(f"kernel rules file {origin}: expected one top-level key `rules:` "
                         "holding a list of rules (kind, pattern, severity, type, clears)")
    lines = _rule_lines(doc)
    out: list[Rule] = []
    for i, raw in enumerate(data["rules"]):
        line = lines[i] if i < len(lines) else 0
        where = f"{origin}:{line}"
        if not isinstance(raw, dict):
            raise RulesError(f"kernel rules file {where}: rule {i} is not a mapping")
        try:
            spec = RuleSpec.model_validate(raw)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'rule'}: {err['msg']}" for err in e.errors()
            )
            raise RulesError(f"kernel rules file {where}: rule {i} (kind {raw.get('kind')!r}): "
                             f"{problems}") from None
        out.append(Rule(
            kind=spec.kind, severity=spec.severity, condition=spec.type == "condition",
            regex=re.compile(spec.pattern), clears=tuple(spec.clears), origin=where,
            needles=required_literals(spec.pattern),
        ))
    return out


def _rule_lines(doc: yaml.Node) -> list[int]:
    if not isinstance(doc, yaml.MappingNode):
        return []
    for key, value in doc.value:
        if getattr(key, "value", None) == "rules" and isinstance(value, yaml.SequenceNode):
            return [item.start_mark.line + 1 for item in value.value]
    return []


