"""`fdl start [--addr host[:port]] [--token CREDENTIAL]`: fire the operator start of a staged window.

On the controller host (or through its sshd tunnel) no credential is needed: the request carries
the header `X-Flodld-Start: 1`, which a web page cannot send cross-site, so a browser on that host
cannot fire the start. From anywhere else, pass the run's *start credential* (64 hex characters,
logged by `flodld serve` as `event=start_credential`). It is derived from the join token and can
arm the start and nothing else; the join token itself never goes over HTTP, and this command
refuses to send it. `fdl start --derive-credential` reads the join token from stdin (or
FDL_JOIN_TOKEN) and prints the start credential.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from fdl.address import format_address, resolve_candidates
from fdl.cli import Command
from fdl.endpoint import request
from flodld import api

TOKEN_ENV = "FDL_START_TOKEN"
JOIN_TOKEN_ENV = "FDL_JOIN_TOKEN"
START_HEADER = "X-Flodld-Start"  # flodld.controller.http.START_HEADER
_JOIN_TOKEN = re.compile(r"[0-9a-fA-F]{32}")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--addr", help="controller host[:port] (bare host gets :1337)")
    parser.add_argument(
        "--token",
        help=f"the run's start credential, 64 hex (needed off the controller host; or ${TOKEN_ENV}); "
        "NOT the join token",
    )
    parser.add_argument(
        "--derive-credential", action="store_true",
        help=f"print the start credential of the join token read from stdin (or ${JOIN_TOKEN_ENV}) and exit",
    )
    parser.add_argument("--project", default=".", help="directory holding fdl.yml (default: .)")


def derive_credential() -> int:
    """`--derive-credential`: join token in (stdin or FDL_JOIN_TOKEN), start credential out."""
    text = os.environ.get(JOIN_TOKEN_ENV) or sys.stdin.readline()
    try:
        salt = api.salt_from_hex(text)
    except api.SaltError as error:
        print(f"fdl start --derive-credential: {error}", file=sys.stderr)
        return 2
    print(api.start_credential(salt))
    return 0


def main(args: argparse.Namespace) -> int:
    if getattr(args, "derive_credential", False):
        return derive_credential()
    token = args.token or os.environ.get(TOKEN_ENV)
    bearer = token.strip() if token else None
    if bearer is not None and _JOIN_TOKEN.fullmatch(bearer):
        # Never put the run's master key on the wire: it is the join token, not the start credential.
        print(
            "fdl start: --token holds 32 hex characters, which is a join token (the run's session salt), not "
            "the start credential; nothing was sent. Pass the 64-hex start credential that `flodld serve` "
            "logs (event=start_credential), or derive it: `fdl start --derive-credential` with the join "
            f"token on stdin or in ${JOIN_TOKEN_ENV}",
            file=sys.stderr,
        )
        return 2
    try:
        candidates = resolve_candidates(args.addr, getattr(args, "env", None), args.project, "start")
    except ValueError as error:
        print(f"fdl start: {error}", file=sys.stderr)
        return 2
    last = "no candidates"
    for host, port in candidates.addresses:
        address = format_address(host, port)
        try:
            reply = request(host, port, "POST", "/start", bearer=bearer, headers={START_HEADER: "1"})
        except OSError as error:
            last = str(error) or repr(error)
            continue
        try:
            body = json.loads(reply.body)
        except ValueError:
            body = {"error": reply.body.decode(errors="replace")}
        if reply.status == 200 and body.get("armed"):
            print(
                f"start armed @ {address} — the world forms with the {body.get('joined_ranks', '?')} rank(s) "
                "staged (watch `fdl status`)"
            )
            return 0
        print(
            f"start refused @ {address}: {reply.status} {reply.reason} — {body.get('error', body)}",
            file=sys.stderr,
        )
        return 1
    print(
        f"fdl start: start not armed at {candidates.describe()} ({candidates.origin}): {last}",
        file=sys.stderr,
    )
    return 1


COMMAND = Command("start", "fire the start of a staged window", __doc__, configure_parser, main)
