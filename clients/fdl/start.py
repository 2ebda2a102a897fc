"""`fdl start [--addr host[:port]] [--token HEX]`: fire the operator start of a staged window."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from fdl.address import format_address, resolve_candidates
from fdl.endpoint import request

TOKEN_ENV = "FDL_START_TOKEN"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser("start", help="fire the start of a staged window")
    parser.add_argument("--addr", help="controller host[:port] (bare host gets :1337)")
    parser.add_argument("--token", help=f"the run token, hex (needed off the controller host; or ${TOKEN_ENV})")
    parser.add_argument("--project", default=".", help="directory holding fdl.yml (default: .)")
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace) -> int:
    try:
        candidates = resolve_candidates(args.addr, getattr(args, "env", None), args.project, "start")
    except ValueError as error:
        print(f"fdl start: {error}", file=sys.stderr)
        return 2
    token = args.token or os.environ.get(TOKEN_ENV)
    bearer = token.strip() if token else None
    last = "no candidates"
    for host, port in candidates.addresses:
        address = format_address(host, port)
        try:
            reply = request(host, port, "POST", "/start", bearer=bearer)
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
        print(f"start refused @ {address}: {reply.status} {reply.reason} — {body.get('error', body)}", file=sys.stderr)
        return 1
    print(f"fdl start: start not armed at {candidates.describe()} ({candidates.origin}): {last}", file=sys.stderr)
    return 1
