"""Launch-bound resources: what a Program needs (requirements) and what the caller supplies (bindings)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any


class ResourceError(LookupError):
    """A required resource is missing or bound with the wrong kind."""


@dataclass(frozen=True)
class ResourceRequirement:
    """A named resource of a given kind, e.g. ("world", "process-group")."""

    symbol: str
    kind: str


@dataclass(frozen=True)
class BoundResource(ResourceRequirement):
    """A live object (a process-group wrapper, a torch.device, an engine) bound to a symbol of a kind."""

    value: Any


class ResourceBindings:
    """The resources one launch provides, looked up by symbol and checked by kind."""

    def __init__(self, resources: Iterable[BoundResource] = ()) -> None:
        self._by_symbol: dict[str, BoundResource] = {}
        for resource in resources:
            if resource.symbol in self._by_symbol:
                raise ResourceError(f"Resource {resource.symbol!r} is bound twice")
            self._by_symbol[resource.symbol] = resource

    @classmethod
    def of(cls, **resources: BoundResource) -> ResourceBindings:
        return cls(resources.values())

    def __contains__(self, symbol: str) -> bool:
        return symbol in self._by_symbol

    def __iter__(self) -> Iterator[BoundResource]:
        return iter(self._by_symbol.values())

    def resolve(self, requirement: ResourceRequirement) -> BoundResource:
        try:
            bound = self._by_symbol[requirement.symbol]
        except KeyError:
            known = ", ".join(sorted(self._by_symbol)) or "none"
            raise ResourceError(
                f"Required resource {requirement.symbol!r} (kind {requirement.kind!r}) is not bound; "
                f"bound resources: {known}"
            ) from None
        if bound.kind != requirement.kind:
            raise ResourceError(
                f"Resource {requirement.symbol!r} has kind {bound.kind!r}; required {requirement.kind!r}"
            )
        return bound

    def resolve_all(self, requirements: Iterable[ResourceRequirement]) -> tuple[BoundResource, ...]:
        return tuple(self.resolve(requirement) for requirement in requirements)

    def overlay(self, other: ResourceBindings) -> ResourceBindings:
        """These bindings with `other`'s entries replacing same-named ones."""
        merged = dict(self._by_symbol)
        merged.update({resource.symbol: resource for resource in other})
        return ResourceBindings(merged.values())

    def merge(self, other: ResourceBindings) -> ResourceBindings:
        """Union of both; a symbol bound in both is an error."""
        return ResourceBindings([*self, *other])

    def select(self, symbols: Iterable[str]) -> ResourceBindings:
        return ResourceBindings(self.resolve_symbol(symbol) for symbol in symbols)

    def resolve_symbol(self, symbol: str) -> BoundResource:
        try:
            return self._by_symbol[symbol]
        except KeyError:
            raise ResourceError(f"Required resource {symbol!r} is not bound") from None

    def as_mapping(self) -> Mapping[str, BoundResource]:
        return dict(self._by_symbol)
