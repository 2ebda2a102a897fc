"""Shared test fixtures: capability gates that skip locally and fail in CI.

CI (`.ci/run`) exports FLODLD_REQUIRE_<NAME>=1 for every capability it installs, so a test that
would silently skip on a developer machine fails loudly there instead.

Tests marked `gpu` skip where torch sees no CUDA device, and fail there under FLODLD_REQUIRE_GPU=1
(set it on a machine that has GPUs, so that a broken driver or a CPU torch build cannot pass as a skip).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
from pathlib import Path

import pytest

# A test run started in the background by a non-interactive shell (`./.ci/run &`, `nohup make test &`)
# inherits SIGINT ignored, and exec keeps an ignored signal ignored: every `fdl` a test starts would then
# ignore the SIGINT a test sends it (Ctrl-C), and `fdl logs --follow` never stops. Tests are about the
# programs' own Ctrl-C handling, so the test process takes Python's default back, and its children get
# the default disposition at exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


def prepare_sshd_privsep() -> None:
    """Make sshd's privilege-separation directory, as openssh-server's tmpfiles.d entry does at boot.

    sshd run as root (CI, the netns hosts) refuses `-t` and `-D` without it, and a fresh container
    has no boot to make it; an unprivileged sshd never looks at it.
    """
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)


@functools.cache
def cuda_device_count() -> int:
    """CUDA devices torch can use here (0 without torch, a CUDA build or a driver)."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The `gpu` marker's gate: skip without a CUDA device, or fail under FLODLD_REQUIRE_GPU=1."""
    if item.get_closest_marker("gpu") is not None:
        require_capability("gpu", cuda_device_count() > 0, "torch sees no CUDA device")
