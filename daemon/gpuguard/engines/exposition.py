"""Prometheus exposition text -> flat samples, and PromQL-style selectors over them.
Parsing is prometheus_client's parser; nothing here splits exposition lines by hand."""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from prometheus_client.parser import text_string_to_metric_families


class ExpositionError(ValueError):
    """The text is not Prometheus exposition format (names the source)."""


@dataclass(frozen=True)
class Selector:
    name: str
    labels: Mapping[str, str]

    @classmethod
    def parse(cls, text: str) -> "Selector":
        """`name` or `name{k="v",...}`; parsed by writing it as a sample line."""
        try:
            families = list(text_string_to_metric_families(f"{text.strip()} 0\n"))
            sample = families[0].samples[0]
        except Exception as exc:  # noqa: BLE001 - parser raises several types
            raise ValueError(f"metric selector {text!r} is not `name{{label=\"value\"}}`: {exc}") from None
        return cls(sample.name, MappingProxyType(dict(sample.labels)))

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        inner = ",".join(f'{k}="{v}"' for k, v in sorted(self.labels.items()))
        return f"{self.name}{{{inner}}}"


@dataclass(frozen=True)
class Samples:
    """Every sample of one scrape, by exact sample name (so `_count`, `_total`, `_bucket` are
    addressed as exposed, whatever the family's TYPE line says)."""

    by_name: Mapping[str, tuple[tuple[Mapping[str, str], float], ...]]

    @classmethod
    def parse(cls, text: str, source: str = "/metrics") -> "Samples":
        table: dict[str, list[tuple[Mapping[str, str], float]]] = {}
        try:
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    table.setdefault(s.name, []).append((MappingProxyType(dict(s.labels)), float(s.value)))
        except Exception as exc:  # noqa: BLE001
            raise ExpositionError(f"{source}: not Prometheus exposition text ({exc})") from None
        return cls(MappingProxyType({k: tuple(v) for k, v in table.items()}))

    def _rows(self, name: str):
        # prometheus_client's parser renames a counter's sample `x` (no suffix, as TGI and
        # other non-Python exporters write it) to `x_total`; a selector for `x` finds either.
        rows = self.by_name.get(name)
        if rows is None and not name.endswith("_total"):
            rows = self.by_name.get(name + "_total")
        return rows or ()

    def has(self, sel: Selector) -> bool:
        return any(_match(labels, sel) for labels, _ in self._rows(sel.name))

    def total(self, selectors: list[Selector] | tuple[Selector, ...]) -> float | None:
        """Sum of all samples matching any selector; None when none matched (absent, not 0)."""
        found = False
        acc = 0.0
        for sel in selectors:
            for labels, value in self._rows(sel.name):
                if _match(labels, sel) and not math.isnan(value):
                    acc += value
                    found = True
        return acc if found else None


def _match(labels: Mapping[str, str], sel: Selector) -> bool:
    return all(labels.get(k) == v for k, v in sel.labels.items())
