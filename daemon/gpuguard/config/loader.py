"""Loading the one YAML config file: parse with pyyaml, validate with pydantic, and
turn every validation error into one line that names the key path and the line number
in the file (`gpus[1].match.bdf (line 14): ...`). An invalid file is never half-used."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import re
from typing import Any

import yaml
from pydantic import ValidationError

from gpuguard.config.schema import Config


@dataclass(frozen=True)
class ConfigProblem:
    key: str  # dotted path, e.g. "poll.interval_seconds" or "gpus[0].match"
    line: int | None  # 1-based line in the file
    message: str

    def __str__(self) -> str:
        where = f" (line {self.line})" if self.line else ""
        return f"{self.key or '<top level>'}{where}: {self.message}"


class ConfigError(Exception):
    def __init__(self, source: str, problems: list[ConfigProblem]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(self.render())

    def render(self) -> str:
        head = f"{self.source}: {len(self.problems)} problem(s)"
        return "\n".join([head] + [f"  {p}" for p in self.problems])


class _Loader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1's base-60 numbers: an unquoted PCI address such as
    0000:05:00.0 must stay the string the user wrote, not become 1500.0."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
        r"|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def _key_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _line_of(node: yaml.Node | None, loc: tuple) -> int | None:
    """Line of the deepest YAML node along `loc` (the key's own line for mapping keys)."""
    best = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(part):
                    best = k.start_mark.line + 1
                    node = v
                    break
            else:
                return best
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                return best
            node = node.value[part]
            best = node.start_mark.line + 1
        else:
            # pydantic adds union-branch / tag names to loc; they have no node
            continue
    return best


def _clean_loc(loc: tuple) -> tuple:
    # pydantic puts discriminator / function names into loc ("function-after[...]");
    # they are not keys a user wrote.
    return tuple(p for p in loc if isinstance(p, int) or ("[" not in str(p) and "-" not in str(p)))


def parse_config(text: str, source: str = "<config>") -> Config:
    try:
        node = yaml.compose(text, Loader=_Loader)
        data: Any = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        line = e.problem_mark.line + 1 if e.problem_mark else None
        raise ConfigError(source, [ConfigProblem("", line, f"not valid YAML: {e.problem}")]) from None
    except yaml.YAMLError as e:
        raise ConfigError(source, [ConfigProblem("", None, f"not valid YAML: {e}")]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, [ConfigProblem("", 1, "the file must be a mapping of sections (poll:, gpus:, ...)")])
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = _clean_loc(tuple(err["loc"]))
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key (check the spelling; see config/gpuguard.yaml for every key)"
            problems.append(ConfigProblem(_key_path(loc), _line_of(node, loc), msg))
        raise ConfigError(source, problems) from None


def load_config(path: str | Path | None) -> Config:
    """Load and validate `path`; None gives the defaults (no file)."""
    if path is None:
        return Config()
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(str(p), [ConfigProblem("", None, f"cannot read: {e.strerror}")]) from None
    return parse_config(text, str(p))
