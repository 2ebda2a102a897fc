"""`fdl join-sshd write|show`: the recipe files and text, and refusals naming the fix."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import pytest
from fdl import join_sshd

from tests.conftest import prepare_sshd_privsep, require_binary


def _key(tmp_path: Path) -> Path:
    keygen = require_binary("sshd", "ssh-keygen")
    subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "walker")], check=True)
    return tmp_path / "walker.pub"


def _args(action: str, **values: object) -> argparse.Namespace:
    base: dict[str, object] = {"action": action, "controller_port": 4242, "listen_port": 2299, "key": [],
                               "user": "flodl-join", "directory": None}  # fmt: skip
    base["listen_address"] = "0.0.0.0"
    base.update(values)
    return argparse.Namespace(**base)


def test_write_lays_out_config_keys_and_host_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = _key(tmp_path)
    out = tmp_path / "door"
    assert join_sshd.main(_args("write", directory=str(out), key=[str(key)])) == 0
    config = (out / "sshd_config").read_text()
    assert "Port 2299" in config and "PermitOpen 127.0.0.1:4242" in config
    line = (out / "authorized_keys").read_text()
    assert line.startswith(
        'restrict,port-forwarding,permitopen="127.0.0.1:4242",command="/usr/sbin/nologin" '
    )
    assert (out / "ssh_host_ed25519_key").exists()
    assert f"sshd -D -e -f {out / 'sshd_config'}" in capsys.readouterr().out
    sshd = require_binary("sshd", "sshd", search_sbin=True)
    prepare_sshd_privsep()
    check = subprocess.run([sshd, "-t", "-f", str(out / "sshd_config")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_write_names_the_privsep_directory_root_sshd_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "no-privsep"
    monkeypatch.setattr(join_sshd, "PRIVSEP_DIR", missing)
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # the os module join_sshd imported
    key = [str(_key(tmp_path))]
    assert join_sshd.main(_args("write", directory=str(tmp_path / "door"), key=key)) == 0
    assert f"sshd run as root needs {missing}: mkdir -m 755 {missing}" in capsys.readouterr().err
    missing.mkdir()
    assert join_sshd.main(_args("write", directory=str(tmp_path / "door2"), key=key)) == 0
    assert "needs" not in capsys.readouterr().err


def test_show_prints_both_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert join_sshd.main(_args("show", key=[str(_key(tmp_path))], user="walkers")) == 0
    text = capsys.readouterr().out
    assert 'permitopen="127.0.0.1:4242"' in text and "Match User walkers" in text


@pytest.mark.parametrize(
    ("values", "fragment"),
    [({"key": []}, "no join key given"), ({"key": ["/nope.pub"]}, "no such file")],
)
def test_missing_keys_are_refused(values: dict[str, object], fragment: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert join_sshd.main(_args("show", **values)) == 2
    assert fragment in capsys.readouterr().err


def test_write_takes_the_listen_address_and_refuses_one_that_is_no_address(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = _key(tmp_path)
    out = tmp_path / "door"
    assert join_sshd.main(_args("write", directory=str(out), key=[str(key)], listen_address="10.0.0.5")) == 0
    config = (out / "sshd_config").read_text().splitlines()
    assert "ListenAddress 10.0.0.5" in config and "ListenAddress 0.0.0.0" not in config
    smuggled = "10.0.0.5\nPermitRootLogin yes"
    assert join_sshd.main(_args("write", directory=str(tmp_path / "d2"), key=[str(key)],
                                listen_address=smuggled)) == 2  # fmt: skip
    assert "is neither an IP address nor a host name" in capsys.readouterr().err
    assert not (tmp_path / "d2").exists()


def test_the_listen_address_flag_defaults_to_every_ipv4_interface() -> None:
    parser = argparse.ArgumentParser()
    join_sshd.configure_parser(parser)
    assert parser.parse_args(["write", "d"]).listen_address == "0.0.0.0"
    assert parser.parse_args(["write", "d", "--listen-address", "::"]).listen_address == "::"
