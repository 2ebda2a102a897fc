"""Load `fdl.yml`, overlay `fdl.<env>.yml`, validate, and report every problem with file:line and key path."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import ValidationError

from flodld.config.errors import ConfigError, ConfigIssue, ConfigNotFoundError
from flodld.config.issues import issues_from_validation
from flodld.config.merge import merge_documents
from flodld.config.models import ProjectConfig
from flodld.config.yamlsource import Position, SourceDocument, parse_yaml, read_yaml

BASE_FILE = "fdl.yml"
_ENV_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_OVERLAY_RE = re.compile(r"^fdl\.([A-Za-z0-9][A-Za-z0-9_-]*)\.yml$")


def overlay_file(project_dir: Path | str, env: str) -> Path:
    return Path(project_dir) / f"fdl.{env}.yml"


def available_envs(project_dir: Path | str) -> list[str]:
    """Names of the overlays present (`fdl.cluster.yml` -> "cluster"), sorted."""
    directory = Path(project_dir)
    if not directory.is_dir():
        return []
    found = (_OVERLAY_RE.match(entry.name) for entry in directory.iterdir() if entry.is_file())
    return sorted(match.group(1) for match in found if match)


def load_config(project_dir: Path | str, env: str | None = None) -> ProjectConfig:
    """The validated project configuration; ConfigError (never anything else) when it cannot be used.

    `env` selects the overlay `fdl.<env>.yml`, deep-merged over `fdl.yml` (see `merge.py`).
    ConfigNotFoundError when neither file exists.
    """
    directory = Path(project_dir)
    base_path = directory / BASE_FILE
    documents: list[SourceDocument] = []
    if base_path.is_file():
        documents.append(read_yaml(base_path))
    if env is not None:
        documents.append(read_yaml(_existing_overlay(directory, env)))
    if not documents:
        raise ConfigNotFoundError(
            ConfigIssue((), f"no {BASE_FILE} in {directory}; create one (see docs/config.md)", base_path)
        )
    merged = documents[0]
    for overlay in documents[1:]:
        merged = merge_documents(merged, overlay)
    return validate_document(merged, default_file=base_path)


def config_overlay_file(config_file: Path | str, env: str) -> Path:
    """The overlay of an explicitly named config file: `other.yml` + env `x` -> `other.x.yml` next to it."""
    path = Path(config_file)
    return path.with_name(f"{path.stem}.{env}{path.suffix}")


def load_config_file(config_file: Path | str, env: str | None = None) -> ProjectConfig:
    """Like `load_config`, for a file named explicitly (`flodld serve --config other.yml --env x`): the
    overlay is `other.x.yml` next to it, whatever the file is called. The base file must exist.
    """
    path = Path(config_file)
    if not path.is_file():
        raise ConfigNotFoundError(ConfigIssue((), f"config file {path} does not exist", path))
    documents = [read_yaml(path)]
    if env is not None:
        if not _ENV_NAME_RE.match(env):
            raise ConfigError(ConfigIssue(
                (), f"environment name {env!r} is invalid; use letters, digits, '-' and '_' (e.g. cluster)"
            ))
        overlay = config_overlay_file(path, env)
        if not overlay.is_file():
            raise ConfigError(
                ConfigIssue(
                    (),
                    f"unknown environment {env!r}: {overlay.name} (the overlay of {path.name}) does not "
                    "exist",
                    overlay,
                )
            )
        documents.append(read_yaml(overlay))
    merged = documents[0]
    for document in documents[1:]:
        merged = merge_documents(merged, document)
    return validate_document(merged, default_file=path)


def validate_document(document: SourceDocument, default_file: Path | None = None) -> ProjectConfig:
    try:
        return ProjectConfig.model_validate(document.data)
    except ValidationError as exc:
        issues = issues_from_validation(exc, document.data, ProjectConfig, document.positions, default_file)
        raise ConfigError(issues) from None


def load_text(text: str, name: str = BASE_FILE) -> ProjectConfig:
    """Validate YAML text as if it were a file called `name` (tests, `fdl config check -`)."""
    return validate_document(parse_yaml(text, Path(name)), default_file=Path(name))


def _existing_overlay(directory: Path, env: str) -> Path:
    if not _ENV_NAME_RE.match(env):
        raise ConfigError(
            ConfigIssue(
                (), f"environment name {env!r} is invalid; use letters, digits, '-' and '_' (e.g. cluster)"
            )
        )
    path = overlay_file(directory, env)
    if path.is_file():
        return path
    envs = available_envs(directory)
    listing = ", ".join(envs) if envs else f"none (no fdl.<env>.yml files in {directory})"
    raise ConfigError(
        ConfigIssue(
            (), f"unknown environment {env!r}: {path.name} does not exist; available: {listing}", path
        )
    )


__all__ = [
    "Position",
    "available_envs",
    "config_overlay_file",
    "load_config",
    "load_config_file",
    "load_text",
    "overlay_file",
    "validate_document",
]
