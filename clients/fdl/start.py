"""`fdl start [--addr host[:port]] [--token CREDENTIAL]`: fire the operator start of a staged window.

On the controller host (or through its sshd tunnel) no credential is needed: the request carries
the header `X-Flodld-Start: 1`, which a web page cannot send cross-site, so a browser on that host
cannot fire the start. From anywhere else, pass the run's *start credential* (64 hex characters,
logged by `flodld serve` as `event=start_credential`). It is derived from the join token and the run
id, and arms the start of that one run and nothing else; the join token itself never goes over HTTP,
and this command refuses to send it. `fdl start --derive-credential` reads the join token from stdin
(or FDL_JOIN_TOKEN) and prints the start credential of the run named by `--run-id`, or, without it,
of the run the controller's state.json shows now (asked at `--addr`, as `fdl status` would). A token
given with `--token` is always checked: a wrong one is refused even where no credential is needed.
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
from fdl.status import NoRun, fetch_state
from flodld import api

TOKEN_ENV = "FDL_START_TOKEN"
JOIN_TOKEN_ENV = "FDL_JOIN_TOKEN"
START_HEADER = "X-Flodld-Start"  # flodld.controller.status.http.START_HEADER
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
        help=f"print the start credential of the join token read from stdin (or ${JOIN_TOKEN_ENV}) for the "
        "run --run-id names (default: the run the controller's state.json shows) and exit",
    )
    parser.add_argument(
        "--run-id", help="with --derive-credential: the run whose credential to derive (state.json's run_id)"
    )
    parser.add_argument("--project", default=".", help="directory holding fdl.yml (default: .)")


def derive_credential(args: argparse.Namespace) -> int:
    """`--derive-credential`: join token in (stdin or FDL_JOIN_TOKEN), the run's start credential out.

    The credential is per run: the run id comes from `--run-id`, else from the controller's
    state.json (the run it hosts now: derive while the window is open, not between runs).
    """
    text = os.environ.get(JOIN_TOKEN_ENV) or sys.stdin.readline()
    try:
        salt = api.salt_from_hex(text)
    except api.SaltError as error:
        print(f"fdl start --derive-credential: {error}", file=sys.stderr)
        return 2
    run_id = getattr(args, "run_id", None)
    if not run_id:
        run_id = _current_run_id(args)
        if run_id is None:
            return 1
    print(api.start_credential(salt, run_id))
    return 0


def _current_run_id(args: argparse.Namespace) -> str | None:
    """The run id the controller's state.json shows (None, with the reason on stderr, when none answers)."""
    try:
        candidates = resolve_candidates(args.addr, getattr(args, "env", None), args.project, "start")
        address, body = fetch_state(candidates, members="0..0")
        state = json.loads(body)
    except (ValueError, NoRun) as error:
        print(
            f"fdl start --derive-credential: the start credential is per run and no run id was found: {error}"
            "\n  pass --run-id <state.json's run_id>, or --addr of the controller",
            file=sys.stderr,
        )
        return None
    run_id = state.get("run_id") if isinstance(state, dict) else None
    if not isinstance(run_id, str) or not run_id:
        print(
            f"fdl start --derive-credential: state.json at {address} names no run id; pass --run-id",
            file=sys.stderr,
        )
        return None
    print(f"fdl start: run {run_id} @ {address} (phase {state.get('phase', '?')})", file=sys.stderr)
    return run_id


def main(args: argparse.Namespace) -> int:
    if getattr(args, "derive_credential", False):
        return derive_credential(args)
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
