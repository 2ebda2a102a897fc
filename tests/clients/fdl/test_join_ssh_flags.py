"""`fdl join --ssh/--identity`: how the forward's endpoint is resolved over the `join.ssh` block."""

from __future__ import annotations

from pathlib import Path

import pytest
from fdl import join as join_command

from tests.clients.fdl.join_args import parse, project


def test_ssh_flag_sets_the_endpoint_and_the_address_is_seen_from_the_ssh_host(tmp_path: Path) -> None:
    directory = project(tmp_path)
    plan = join_command.resolve_plan(
        parse(
            "--project",
            str(directory),
            "--bin",
            str(directory / "train.py"),
            "--ssh",
            "walker@gate:2222",
            "--identity",
            "/k/join",
        )
    )
    assert plan.ssh is not None
    assert (plan.ssh.user, plan.ssh.host, plan.ssh.port, plan.ssh.identity_file) == (
        "walker",
        "gate",
        2222,
        "/k/join",
    )
    assert (plan.spec.controller_host, plan.spec.controller_port) == ("127.0.0.1", 1337)


def test_join_ssh_block_supplies_target_and_options(tmp_path: Path) -> None:
    directory = project(tmp_path, (
        "join:\n  address: 127.0.0.1:4000\n  ssh:\n    target: gate.lan\n    port: 2200\n    user: j\n"
        "    identity_file: /k/id\n    options: [StrictHostKeyChecking=accept-new]\n"
    ))  # fmt: skip
    plan = join_command.resolve_plan(
        parse("--project", str(directory), "--bin", str(directory / "train.py"))
    )
    assert plan.ssh is not None
    assert (plan.ssh.host, plan.ssh.port, plan.ssh.user, plan.ssh.identity_file) == (
        "gate.lan",
        2200,
        "j",
        "/k/id",
    )
    assert plan.ssh.parsed["StrictHostKeyChecking"] == "accept-new"
    assert plan.spec.controller_port == 4000


def test_no_ssh_means_a_direct_dial(tmp_path: Path) -> None:
    directory = project(tmp_path)
    plan = join_command.resolve_plan(
        parse("--project", str(directory), "--bin", str(directory / "train.py"))
    )
    assert plan.ssh is None


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [(("--identity", "/k"), "--identity only applies with --ssh"), (("--ssh", "gate:notaport"), "bad port")],
)
def test_bad_ssh_flags_are_usage_errors(tmp_path: Path, flags: tuple[str, ...], fragment: str) -> None:
    directory = project(tmp_path)
    with pytest.raises(join_command.UsageError, match=fragment):
        join_command.resolve_plan(
            parse("--project", str(directory), "--bin", str(directory / "train.py"), *flags)
        )
