"""The guardrailed join sshd: text of the authorized_keys line and sshd configs (pure).

A join key must be worth nothing more than one port forward to the controller port. Two
layers enforce that, so a mistake in either is caught by the other:
  * the key's own authorized_keys options (`restrict` + `port-forwarding` + `permitopen` +
    a forced `command=`), and
  * the daemon's configuration (a `Match User` block on a shared sshd, or global settings on
    a dedicated, unprivileged sshd instance that serves join keys only).

The dedicated instance runs as the join user itself (an sshd that is not root can only log in the
user it runs as; see systemd/fdl-join-sshd@.service), and its config also says so: `AllowUsers`
names the join user only and `PermitRootLogin no`. A key line is accepted only whole: type, base64
blob, optional printable comment, nothing else. A newline (or any
control character) inside a key string is refused, so one key can never become a second,
unrestricted authorized_keys line.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

NOLOGIN = "/usr/sbin/nologin"
_KEY_TYPES = (
    "ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp256|ecdsa-sha2-nistp384|ecdsa-sha2-nistp521|sk-ssh-ed25519@openssh\\.com"
)
# The whole line, anchored at both ends: type, one space-separated base64 blob, an optional comment
# of printable characters. No option prefix, no second key, no control character anywhere.
_KEY_LINE = re.compile(
    rf"(?P<type>{_KEY_TYPES})[ \t]+(?P<blob>[A-Za-z0-9+/]+={{0,2}})(?:[ \t]+(?P<comment>[\x20-\x7e]*))?"
)
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # every control character but tab
_USER = re.compile(r"[a-z_][a-z0-9_.-]{0,31}")
_HOST_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})")


def check_listen_address(address: str) -> str:
    """An IP literal or a host name for sshd's ListenAddress; nothing that could add a config line."""
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    if not _HOST_NAME.fullmatch(address):
        raise RecipeError(
            f"listen address {address!r} is neither an IP address nor a host name; e.g. 10.0.0.5, "
            "0.0.0.0 (every IPv4 interface) or :: (every interface)"
        )
    return address


def check_public_key(key: str) -> str:
    """The key line, stripped of surrounding blanks, or RecipeError: one OpenSSH public key, whole."""
    stripped = key.strip(" \t")
    if _CONTROL.search(stripped.rstrip("\n")):  # one trailing newline (a .pub file's) is fine
        raise RecipeError(
            f"public key {stripped[:40]!r}... holds a newline or control character: one key string must be "
            "one authorized_keys line; pass each key on its own (the contents of one .pub file)"
        )
    stripped = stripped.rstrip("\n").strip(" \t")
    found = _KEY_LINE.fullmatch(stripped)
    if found is None:
        raise RecipeError(
            f"not an OpenSSH public key line: {stripped[:40]!r}; pass the contents of a .pub file"
        )
    return stripped


class RecipeError(ValueError):
    """A recipe input is malformed; the message says which and how to fix it."""


@dataclass(frozen=True)
class JoinSshdRecipe:
    """What one join sshd needs: the controller port its keys may reach and the keys."""

    controller_port: int
    listen_port: int
    public_keys: tuple[str, ...]
    controller_host: str = "127.0.0.1"
    join_user: str = "flodl-join"
    listen_address: str = "0.0.0.0"  # the dedicated instance's ListenAddress

    def __post_init__(self) -> None:
        check_listen_address(self.listen_address)
        for name, port in (("controller_port", self.controller_port), ("listen_port", self.listen_port)):
            if not 1 <= port <= 65535:
                raise RecipeError(f"{name} must be in 1..65535, got {port}")
        for key in self.public_keys:
            check_public_key(key)
        if not _USER.fullmatch(self.join_user) or self.join_user == "root":
            raise RecipeError(
                f"join_user {self.join_user!r} must be an unprivileged account name (not root), e.g. "
                "flodl-join"
            )

    @property
    def permit_open(self) -> str:
        return f"{self.controller_host}:{self.controller_port}"

    def authorized_key_line(self, public_key: str) -> str:
        """One authorized_keys entry: everything off, one forward on, commands neutralised."""
        options = f'restrict,port-forwarding,permitopen="{self.permit_open}",command="{NOLOGIN}"'
        return f"{options} {check_public_key(public_key)}"

    def authorized_keys(self) -> str:
        return "".join(self.authorized_key_line(key) + "\n" for key in self.public_keys)

    def match_block(self) -> str:
        """The daemon-level layer for a shared system sshd (append to sshd_config)."""
        return (
            f"Match User {self.join_user}\n"
            "    AllowTcpForwarding local\n"
            f"    PermitOpen {self.permit_open}\n"
            f"    ForceCommand {NOLOGIN}\n"
            "    PermitTTY no\n"
            "    X11Forwarding no\n"
            "    AllowAgentForwarding no\n"
            "    AllowStreamLocalForwarding no\n"
            "    PermitTunnel no\n"
            "    GatewayPorts no\n"
        )

    def dedicated_config(self, directory: Path) -> str:
        """sshd_config for a dedicated instance on `listen_port` serving join keys only.

        The restrictions are global here because every key this instance accepts is a join key. The
        instance runs as `join_user` (not root: `sshd -D -e -f DIR/sshd_config` as that user, or the
        systemd unit), and only that user may log in.
        """
        return (
            f"Port {self.listen_port}\n"
            f"ListenAddress {check_listen_address(self.listen_address)}\n"
            f"AllowUsers {self.join_user}\n"
            "PermitRootLogin no\n"
            f"HostKey {directory / 'ssh_host_ed25519_key'}\n"
            f"PidFile {directory / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {directory / 'authorized_keys'}\n"
            "StrictModes no\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "PubkeyAuthentication yes\n"
            "UsePAM no\n"
            "AllowTcpForwarding local\n"
            f"PermitOpen {self.permit_open}\n"
            f"ForceCommand {NOLOGIN}\n"
            "PermitTTY no\n"
            "X11Forwarding no\n"
            "AllowAgentForwarding no\n"
            "AllowStreamLocalForwarding no\n"
            "PermitTunnel no\n"
            "GatewayPorts no\n"
            "PermitUserRC no\n"
            "ClientAliveInterval 15\n"
            "ClientAliveCountMax 4\n"
            "LogLevel VERBOSE\n"
        )

    def write(self, directory: Path) -> list[Path]:
        """Write sshd_config and authorized_keys into `directory` (host key: see `host_key_command`)."""
        directory.mkdir(parents=True, exist_ok=True)
        config = directory / "sshd_config"
        keys = directory / "authorized_keys"
        config.write_text(self.dedicated_config(directory))
        keys.write_text(self.authorized_keys())
        keys.chmod(0o600)
        return [config, keys]

    @staticmethod
    def host_key_command(directory: Path) -> list[str]:
        return ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / "ssh_host_ed25519_key")]
