"""Shared test fixtures: capability gates that skip locally and fail in CI.

CI (`.ci/run`) exports FLODLD_REQUIRE_<NAME>=1 for every capability it installs, so a test that
would silently skip on a developer machine fails loudly there instead.
"""

from __future__ import annotations

import os
import shutil

import pytest


def require_capability(name: str, available: bool, why: str) -> None:
    """Skip when `available` is false, unless CI demands the capability, then fail."""
    if available:
        return
    message = f"{name} unavailable: {why}"
    if os.environ.get(f"FLODLD_REQUIRE_{name.upper()}") == "1":
        pytest.fail(f"{message} (FLODLD_REQUIRE_{name.upper()}=1 makes this a failure)")
    pytest.skip(message)


def require_binary(name: str, binary: str, *, search_sbin: bool = False) -> str:
    """Return the path of `binary`, skipping or failing (see `require_capability`) when absent."""
    path = shutil.which(binary)
    if path is None and search_sbin:
        for folder in ("/usr/sbin", "/sbin", "/usr/local/sbin"):
            candidate = os.path.join(folder, binary)
            if os.access(candidate, os.X_OK):
                path = candidate
                break
    require_capability(name, path is not None, f"`{binary}` not found on PATH")
    assert path is not None
    return path
