"""Run a join sshd the way the recipe means it: as the unprivileged join user, never as root.

A non-root sshd can log in only the user it runs as, and the recipe's config allows only the join
user (`AllowUsers`, `PermitRootLogin no`). Under a non-root test runner that user is the runner
itself; under root (CI containers) it is a system account created once (`flodl-join-test`), and
sshd is started through `setpriv` as that account, with the door's files root-owned and readable
by its group only (as docs/multi-host.md prescribes).
"""

from __future__ import annotations

import getpass
import grp
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

TEST_JOIN_USER = "flodl-join-test"


def join_user() -> str:
    """The account the door's sshd runs as and the walk-in logs in as."""
    if os.geteuid() != 0:
        return getpass.getuser()
    try:
        pwd.getpwnam(TEST_JOIN_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--shell", "/usr/sbin/nologin", "--home-dir", "/nonexistent",
                        "--user-group", TEST_JOIN_USER], check=True, capture_output=True)  # fmt: skip
    return TEST_JOIN_USER


def door_directory() -> Path:
    """A fresh directory the join user can reach (pytest's tmp_path under root is 0700 root)."""
    path = Path(tempfile.mkdtemp(prefix="flodl-door-"))
    path.chmod(0o755)
    return path


def hand_to_join_user(directory: Path, user: str) -> None:
    """Root keeps ownership; the join user's group may read (sshd accepts a 0640 host key it does not own)."""
    if os.geteuid() != 0:
        return
    group = grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name
    for path in [directory, *directory.iterdir()]:
        shutil.chown(path, group=group)
        if path.is_file():
            path.chmod(0o640 if not path.name.endswith((".pub", "_config")) else 0o644)


def as_join_user(argv: list[str], user: str) -> list[str]:
    """`argv` run as the join user (through setpriv when we are root)."""
    if os.geteuid() != 0:
        return argv
    entry = pwd.getpwnam(user)
    setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
    return [setpriv, f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups", *argv]
