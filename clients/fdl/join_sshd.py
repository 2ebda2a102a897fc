"""`fdl join-sshd write DIR --controller-port P --listen-port L [--listen-address A] --key K.pub ...`, `show`.

`write` lays out a dedicated, unprivileged sshd for walk-ins (sshd_config, authorized_keys and a
fresh host key) that lets each join key forward to 127.0.0.1:P and do nothing else; start it with
`sshd -D -e -f DIR/sshd_config` (any user, L > 1024). `show` prints the authorized_keys lines and
the `Match User` block to add to an existing system sshd instead. See docs/multi-host.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from fdl.cli import Command, usage_error
from flodld import api

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
PRIVSEP_DIR = Path("/run/sshd")  # sshd as root chroots its unprivileged child here


def configure_parser(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    write = actions.add_parser("write", help="write sshd_config, authorized_keys and a host key into DIR")
    write.add_argument("directory", metavar="DIR")
    write.add_argument(
        "--listen-address", default="0.0.0.0", metavar="ADDR",
        help="address the dedicated sshd listens on (default 0.0.0.0: every IPv4 interface; :: for IPv6 too)",
    )  # fmt: skip
    show = actions.add_parser("show", help="print the authorized_keys lines and the Match User block")
    for sub in (write, show):
        sub.add_argument(
            "--controller-port", type=int, default=1337, help="the controller's mux port (default 1337)"
        )
        sub.add_argument(
            "--listen-port", type=int, default=2222, help="port of the dedicated sshd (default 2222)"
        )
        sub.add_argument("--key", action="append", default=[], metavar="KEY.pub",
                         help="a walk-in's public key file (repeat for several)")  # fmt: skip
        sub.add_argument(
            "--user", default="flodl-join", help="the join user of the Match block (default flodl-join)"
        )


def _recipe(args: argparse.Namespace) -> api.JoinSshdRecipe:
    keys: list[str] = []
    for name in args.key:
        path = Path(name).expanduser()
        if not path.is_file():
            raise api.RecipeError(f"--key {name}: no such file; pass the walk-in's .pub file")
        keys.extend(
            line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")
        )
    if not keys:
        raise api.RecipeError(
            "no join key given; pass --key KEY.pub (the walk-in's public key) at least once"
        )
    return api.JoinSshdRecipe(controller_port=args.controller_port, listen_port=args.listen_port,
                              public_keys=tuple(keys), join_user=args.user,
                              listen_address=getattr(args, "listen_address", None) or "0.0.0.0")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    try:
        recipe = _recipe(args)
    except api.RecipeError as error:
        return usage_error("join-sshd", error)
    if args.action == "show":
        print("# authorized_keys (on the join user):")
        print(recipe.authorized_keys(), end="")
        print("\n# sshd_config (append; then `sshd -t` and reload):")
        print(recipe.match_block(), end="")
        return EXIT_OK
    directory = Path(args.directory).resolve()
    if args.listen_port <= 1024:
        print(f"fdl join-sshd: note: port {args.listen_port} needs root; a port > 1024 runs unprivileged",
              file=sys.stderr)  # fmt: skip
    written = recipe.write(directory)
    host_key = directory / "ssh_host_ed25519_key"
    if not host_key.exists():
        try:
            subprocess.run(recipe.host_key_command(directory), check=True)
        except (OSError, subprocess.CalledProcessError) as error:
            print(f"fdl join-sshd: ssh-keygen failed ({error}); install openssh-client", file=sys.stderr)
            return EXIT_FAILED
    for path in [*written, host_key]:
        print(f"wrote {path}")
    if os.geteuid() == 0 and not PRIVSEP_DIR.is_dir():
        # sshd run as root refuses to start without it ("Missing privilege separation directory");
        # the openssh-server package's tmpfiles.d entry makes it at boot, a container may lack it.
        print(f"fdl join-sshd: note: sshd run as root needs {PRIVSEP_DIR}: mkdir -m 755 {PRIVSEP_DIR}",
              file=sys.stderr)  # fmt: skip
    print(f"start it:  sshd -D -e -f {directory / 'sshd_config'}")
    print(f"walk-ins:  fdl join --ssh USER@THIS_HOST:{args.listen_port} --identity KEY "
          f"127.0.0.1:{args.controller_port} --bin PROGRAM")  # fmt: skip
    return EXIT_OK


COMMAND = Command(
    "join-sshd", "write or show the guardrailed join sshd recipe", __doc__, configure_parser, main
)

if __name__ == "__main__":
    sys.exit(COMMAND.standalone())
