"""Loading the one YAML config file: parse with pyyaml, validate with pydantic, and
turn every validation error into one line that names the key path and the line number
in the file (`gpus[1].match.bdf (line 14): ...`). An invalid file is never half-used.

Hostile files are answers too, never tracebacks: a file over MAX_BYTES, one
that is not UTF-8 (the line of the first bad byte is named), YAML nested deeper than
MAX_DEPTH (pyyaml composes recursively: 10,000 levels was a RecursionError), anchors
that expand past MAX_NODES (a "billion laughs" file)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import re
from typing import Any

import yaml
from pydantic import ValidationError

from gpuguard.config.schema import Config, KeyedProblems


@dataclass(frozen=True)
class ConfigProblem:
    key: str  # dotted path, e.g. "poll.interval_seconds" or "gpus[0].match"
    line: int | None  # 1-based line in the file
    message: str

    def __str__(self) -> str:
        where = f" (line {self.line})" if self.line else ""
        message = " ".join(self.message.split())  # one line each, whatever pyyaml printed
        key = self.key if self.key.isprintable() else repr(self.key)  # a key may hold a newline
        return f"{key or '<top level>'}{where}: {message}"


class ConfigError(Exception):
    def __init__(self, source: str, problems: list[ConfigProblem]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(self.render())

    def render(self) -> str:
        head = f"{self.source}: {len(self.problems)} problem(s)"
        return "\n".join([head] + [f"  {p}" for p in self.problems])


MAX_BYTES = 1 << 20  # a config is a few KiB; a megabyte is a mistake or an attack
MAX_DEPTH = 32  # the schema nests 5 deep
MAX_NODES = 100_000


class _TooDeep(yaml.MarkedYAMLError):
    pass


class _Loader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1's base-60 numbers: an unquoted PCI address such as
    0000:05:00.0 must stay the string the user wrote, not become 1500.0. Nesting and
    node count are bounded while composing, before anything recurses deeply."""

    _depth = 0
    _nodes = 0

    def compose_node(self, parent, index):  # type: ignore[override]
        self._depth += 1
        self._nodes += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooDeep(None, None, f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            if self._nodes > MAX_NODES:
                raise _TooDeep(None, None, f"more than {MAX_NODES} values", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


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


def _clean_loc(loc: tuple, data: Any) -> tuple:
    """The keys a user wrote, out of pydantic's loc: it adds discriminator / function
    names ("function-after[...]", "tagged-union[...]"). A part that is a key (or index)
    in the data is the user's, whatever characters it holds (a profile named
    `r9700-psu-safe` was dropped for its `-`); one that is not (a missing field) is kept
    unless it has the look of pydantic's own names."""
    out = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            out.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            out.append(part)
            node = node[part]
        elif isinstance(part, int) or ("[" not in str(part) and "-" not in str(part)):
            out.append(part)
            node = None
    return tuple(out)


def _problems(err: dict, data: Any, node: yaml.Node | None) -> list[ConfigProblem]:
    """One pydantic error as problems: a cross-reference check (KeyedProblems) gives one
    per value at fault, keyed below the model that raised it."""
    loc = _clean_loc(tuple(err["loc"]), data)
    keyed = (err.get("ctx") or {}).get("error")
    if isinstance(keyed, KeyedProblems):
        return [ConfigProblem(_key_path(loc + sub), _line_of(node, loc + sub), msg) for sub, msg in keyed.problems]
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key (check the spelling; see config/gpuguard.yaml for every key)"
    return [ConfigProblem(_key_path(loc), _line_of(node, loc), msg)]


def _expanded_size(node: yaml.Node | None, limit: int) -> int:
    """Values the document expands to once aliases are followed (a "billion laughs"
    file is small but expands without bound); stops counting past `limit`."""
    total = 0
    stack = [node] if node is not None else []
    while stack and total <= limit:
        n = stack.pop()
        total += 1
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                stack.extend((k, v))
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)
    return total


def parse_config(text: str, source: str = "<config>") -> Config:
    try:
        node = yaml.compose(text, Loader=_Loader)
        if _expanded_size(node, MAX_NODES) > MAX_NODES:
            raise ConfigError(source, [ConfigProblem("", None, f"expands to more than {MAX_NODES} values "
                                                             "(YAML aliases); write the values out")])
        data: Any = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        line = e.problem_mark.line + 1 if e.problem_mark else None
        raise ConfigError(source, [ConfigProblem("", line, f"not valid YAML: {e.problem}")]) from None
    except yaml.YAMLError as e:
        raise ConfigError(source, [ConfigProblem("", None, f"not valid YAML: {e}")]) from None
    except RecursionError:  # a construct the depth bound did not foresee: still an answer
        raise ConfigError(source, [ConfigProblem("", None, "not valid YAML: nested too deeply")]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, [ConfigProblem("", 1, "the file must be a mapping of sections (poll:, gpus:, ...)")])
    try:
        return Config.model_validate(data)
    except RecursionError:
        raise ConfigError(source, [ConfigProblem("", None, "nested too deeply")]) from None
    except ValidationError as e:
        problems = [p for err in e.errors() for p in _problems(err, data, node)]
        raise ConfigError(source, problems) from None


def load_config(path: str | Path | None) -> Config:
    """Load and validate `path`; None gives the defaults (no file)."""
    if path is None:
        return Config()
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(str(p), [ConfigProblem("", None, f"cannot read: {e.strerror}")]) from None
    return parse_config_bytes(raw, str(p))


def parse_config_bytes(raw: bytes, source: str = "<config>") -> Config:
    if len(raw) > MAX_BYTES:
        raise ConfigError(source, [ConfigProblem("", None, f"larger than {MAX_BYTES} bytes; is this the config file?")])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(source, [ConfigProblem("", line, f"not UTF-8 text: byte 0x{raw[e.start]:02x} at offset "
                                                           f"{e.start} (save the file as UTF-8)")]) from None
    return parse_config(text, source)
