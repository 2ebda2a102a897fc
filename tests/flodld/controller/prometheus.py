"""Strict reading of the controller's /metrics text for tests, on top of prometheus_client's parser.

`parse_strict` parses with `prometheus_client.parser.text_string_to_metric_families` (which raises on
malformed text, label escaping included) and then holds the exposition to the conventions the docs
promise: every family has HELP and TYPE before its samples, counters end in `_total`, names are
`flodld_` snake case, a unit word in a name is a base unit and comes last (before `_total`), each
histogram and summary sample belongs to its family, and no family appears twice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

NAME = re.compile(r"^flodld_[a-z][a-z0-9_]*[a-z0-9]$")
# Non-base units Prometheus asks not to use; base units must end the name (then `_total` for counters).
NON_BASE_UNITS = ("_milliseconds", "_ms", "_kilobytes", "_megabytes", "_minutes", "_hours", "_kb", "_mb")
BASE_UNITS = ("seconds", "bytes")
SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


@dataclass
class Family:
    name: str  # as exposed in HELP/TYPE (a counter's with its `_total`)
    kind: str
    help: str
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (sample name, sorted labels) -> value

    def value(self, sample: str | None = None, **labels: str) -> float:
        return self.samples[(sample or self.name, tuple(sorted(labels.items())))]

    def labelled(self, sample: str | None = None) -> dict[tuple[tuple[str, str], ...], float]:
        wanted = sample or self.name
        return {labels: value for (name, labels), value in self.samples.items() if name == wanted}


def parse_strict(text: str) -> dict[str, Family]:
    """Families by exposed name; AssertionError naming the first convention broken."""
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    order: list[str] = []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            assert name not in helps, f"HELP for {name} twice"
            assert help_text.strip(), f"{name} has an empty HELP"
            helps[name] = help_text
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert name in helps, f"TYPE for {name} before (or without) its HELP"
            assert name not in types, f"TYPE for {name} twice"
            types[name] = kind
            order.append(name)
        elif line.startswith("#") or not line.strip():
            continue
        else:
            sample = re.split(r"[{ ]", line, maxsplit=1)[0]
            assert order and _belongs(sample, order[-1], types[order[-1]]), (
                f"sample {sample} is not a sample of the family announced before it "
                f"({order[-1] if order else None})"
            )
    assert text.endswith("\n"), "the exposition ends with a newline"
    families: dict[str, Family] = {}
    for name, kind in types.items():
        assert NAME.match(name), f"{name}: not flodld_ snake case"
        assert kind in SAMPLE_SUFFIXES, f"{name}: unknown TYPE {kind}"
        assert (kind == "counter") == name.endswith("_total"), (
            f"{name}: counters and only counters end in _total"
        )
        stem = name.removesuffix("_total")
        assert not any(unit in f"{stem}_" for unit in NON_BASE_UNITS), (
            f"{name}: use base units (seconds, bytes)"
        )
        for unit in BASE_UNITS:
            if f"_{unit}_" in f"{stem}_":
                assert stem.endswith(f"_{unit}"), f"{name}: the unit {unit} ends the name"
        if kind in ("histogram", "summary"):
            assert stem.endswith(BASE_UNITS), f"{name}: a {kind} names its unit"
        families[name] = Family(name, kind, helps[name], {})
    parsed = list(text_string_to_metric_families(text))  # raises on malformed text or escaping
    for family in parsed:
        exposed = f"{family.name}_total" if family.type == "counter" else family.name
        assert exposed in families, f"parser found {exposed}, not announced"
        assert families[exposed].kind == family.type, f"{exposed}: type {family.type}"
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in families[exposed].samples, f"duplicate sample {key}"
            families[exposed].samples[key] = sample.value
    for announced in families.values():
        if announced.kind == "histogram":
            _check_histogram(announced)
    return families


def _belongs(sample: str, family: str, kind: str) -> bool:
    stem = family.removesuffix("_total") if kind == "counter" else family
    return any(sample == f"{stem}{suffix}" for suffix in SAMPLE_SUFFIXES[kind])


def _check_histogram(family: Family) -> None:
    """Buckets are cumulative, end in +Inf, and +Inf equals the count, per label set."""
    by_series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    for (name, labels), value in family.samples.items():
        if name.endswith("_bucket"):
            rest = tuple(item for item in labels if item[0] != "le")
            bound = float(dict(labels)["le"])
            by_series.setdefault(rest, []).append((bound, value))
    for rest, buckets in by_series.items():
        buckets.sort()
        counts = [count for _, count in buckets]
        assert counts == sorted(counts), f"{family.name}{dict(rest)}: buckets not cumulative"
        assert buckets[-1][0] == float("inf"), f"{family.name}{dict(rest)}: no +Inf bucket"
        assert buckets[-1][1] == family.value(f"{family.name}_count", **dict(rest))
