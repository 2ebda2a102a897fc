"""Deep-merge an overlay (fdl.<env>.yml) over the base (fdl.yml), keeping each key's source position.

Semantics: mappings merge key by key, recursively; any other overlay value (scalar or list) replaces
the base value whole (a `workers:` list in an overlay is the complete roster); an overlay `null`
removes the key, so the model's default applies again.
"""

from __future__ import annotations

from typing import Any

from flodld.config.errors import KeyPath
from flodld.config.yamlsource import Position, SourceDocument


def merge_documents(base: SourceDocument, overlay: SourceDocument) -> SourceDocument:
    positions = dict(base.positions)
    data = _merge(base.data, overlay.data, (), positions, overlay.positions)
    return SourceDocument(data=data, positions=positions)


def _merge(
    base: dict[str, Any],
    overlay: dict[str, Any],
    key_path: KeyPath,
    positions: dict[KeyPath, Position],
    overlay_positions: dict[KeyPath, Position],
) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overlay.items():
        child: KeyPath = (*key_path, key)
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            positions[child] = overlay_positions[child]
            merged[key] = _merge(merged[key], value, child, positions, overlay_positions)
            continue
        if key in merged:
            for path in _subtree_paths(merged[key], child):
                positions.pop(path, None)
        if value is None:
            merged.pop(key, None)
            continue
        merged[key] = value
        for path in _subtree_paths(value, child):
            if path in overlay_positions:
                positions[path] = overlay_positions[path]
    return merged


def _subtree_paths(value: object, prefix: KeyPath) -> list[KeyPath]:
    """Every key path at or under `prefix` within `value` (linear in the subtree's size)."""
    paths: list[KeyPath] = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            paths.extend(_subtree_paths(child, (*prefix, key)))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            paths.extend(_subtree_paths(child, (*prefix, index)))
    return paths
