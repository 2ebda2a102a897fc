"""`flodld serve` flags: the overlay of an explicit --config, the window flags over the config, and a real
daemon whose window follows --discovery / --min-ranks.
"""

from __future__ import annotations

import argparse
import json
import secrets
from pathlib import Path

import pytest

from flodld.config.errors import ConfigError
from flodld.controller.daemon import add_serve_arguments, options_from_args, unjoinable_warning
from flodld.wire.join import WorldFormed
from flodld.wire.salt import salt_from_hex

from .agents import join
from .daemon_proc import start_daemon
from .starthttp import raw, serve_exit, stop


def parse(*words: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(words))


def cluster(port: int, join: str = "{join_timeout: 30}") -> str:
    return (f"cluster:\n  controller:\n    host: 127.0.0.1\n    port: {port}\n    join: {join}\n"
            "  workers:\n    - {host: 127.0.0.1, local_devices: [cpu]}\n")  # fmt: skip


def test_env_reads_the_overlay_of_the_named_config_file_not_fdl_env_yml(tmp_path: Path) -> None:
    (tmp_path / "other.yml").write_text(cluster(1111))
    (tmp_path / "other.x.yml").write_text("cluster:\n  controller:\n    port: 2222\n")
    (tmp_path / "fdl.x.yml").write_text(cluster(3333))  # a decoy: the overlay of fdl.yml, not of other.yml
    options = options_from_args(parse("--config", str(tmp_path / "other.yml"), "--env", "x"))
    assert options.port == 2222
    assert options_from_args(parse("--config", str(tmp_path / "other.yml"))).port == 1111


def test_a_missing_overlay_of_the_named_config_names_it(tmp_path: Path) -> None:
    (tmp_path / "other.yml").write_text(cluster(1111))
    (tmp_path / "fdl.y.yml").write_text(cluster(3333))
    with pytest.raises(ConfigError, match=r"other\.y\.yml \(the overlay of other\.yml\) does not exist"):
        options_from_args(parse("--config", str(tmp_path / "other.yml"), "--env", "y"))


async def test_serve_with_a_missing_overlay_exits_2(tmp_path: Path) -> None:
    (tmp_path / "other.yml").write_text(cluster(0))
    code, err = await serve_exit("--config", str(tmp_path / "other.yml"), "--env", "nope")
    assert code == 2 and "other.nope.yml" in err, err


def test_window_flags_override_the_config(tmp_path: Path) -> None:
    config = tmp_path / "fdl.yml"
    config.write_text(cluster(1111, "{join_timeout: 30, min_rank_start: 1}"))
    options = options_from_args(
        parse("--config", str(config), "--min-ranks", "3", "--discovery", "--open-admission")
    )
    join_config = options.join
    assert (join_config.min_rank_start, join_config.discovery, join_config.open_admission) == (3, True, True)
    assert join_config.join_timeout == 30 and not join_config.tunnel_only
    tunnel = options_from_args(parse("--discovery", "--min-ranks", "1", "--tunnel-only"))
    assert tunnel.join.tunnel_only and tunnel.effective_bind_host == "127.0.0.1"
    plain = options_from_args(parse("--ranks", "2"))
    assert (
        plain.join.min_rank_start,
        plain.join.discovery,
        plain.join.open_admission,
        plain.join.tunnel_only,
    ) == (None, False, False, False)


@pytest.mark.multiproc
async def test_a_discovery_daemon_waits_for_min_ranks_then_forms() -> None:
    token = secrets.token_hex(16)
    daemon = await start_daemon("--discovery", "--min-ranks", "2", "--target", "2", "--token", token,
                                "--window", "20")  # fmt: skip
    try:
        first = await join(daemon.port, salt_from_hex(token), "walk-a")  # no roster: discovery admits it
        assert first.accepted.ranks == [0]
        _, _, body = await raw(daemon.port, "GET", "/state.json")
        state = json.loads(body)
        assert state["quorum"] == 2 and state["joined_ranks"] == 1 and state["phase"] == "waiting", state
        second = await join(daemon.port, salt_from_hex(token), "walk-b")
        assert second.accepted.ranks == [1]
        for agent in (first, second):
            formed = await agent.next(10)
            assert isinstance(formed, WorldFormed) and formed.envelope.world_size == 2
            await agent.stream.aclose()
    finally:
        await stop(daemon)


@pytest.mark.multiproc
async def test_min_ranks_without_discovery_or_ranks_has_no_window_to_size_and_exits_2() -> None:
    code, err = await serve_exit("--min-ranks", "1", "--bind", "127.0.0.1")
    assert code == 2 and "min_rank_start (1)" in err, err


def test_only_a_tokenless_network_bind_is_unjoinable() -> None:
    warning = unjoinable_warning(options_from_args(parse("--ranks", "2")))
    assert warning is not None and "no join token on the network bind 0.0.0.0" in warning
    assert "--token" in warning and "--bind 127.0.0.1" in warning
    token = secrets.token_hex(16)
    for joinable in (
        parse("--ranks", "2", "--token", token),
        parse("--ranks", "2", "--bind", "127.0.0.1"),
        parse("--ranks", "2", "--open-admission"),
        parse("--discovery", "--min-ranks", "1", "--tunnel-only"),
    ):
        assert unjoinable_warning(options_from_args(joinable)) is None, joinable


@pytest.mark.multiproc
async def test_a_tokenless_network_daemon_warns_at_start_that_nobody_can_join() -> None:
    daemon = await start_daemon("--ranks", "2", "--bind", "0.0.0.0")
    try:
        before_listening = daemon.log.decode(errors="replace")
    finally:
        await stop(daemon)
    assert "WARNING flodld.controller event=unjoinable_window no join token on the network bind" in (
        before_listening
    )


@pytest.mark.multiproc
async def test_a_bare_serve_names_ranks_and_exits_2() -> None:
    code, err = await serve_exit("--bind", "127.0.0.1")
    assert code == 2, err
    assert "pass --ranks N (the ranks to wait for), --config FILE" in err and "workers: is empty" not in err


def test_elastic_max_ranks_sets_growth_and_is_refused_with_a_process_group_mode(tmp_path: Path) -> None:
    options = options_from_args(parse("--elastic-max-ranks", "4", "--tolerance", "1"))
    assert options.join.elastic_max_ranks == 4 and options.growable
    with pytest.raises(ValueError, match=r"elastic_max_ranks .* needs a CPU averaging mode, not nccl_sync"):
        options_from_args(parse("--elastic-max-ranks", "4", "--averaging", "nccl_sync"))
    (tmp_path / "fdl.yml").write_text(cluster(1111, "{elastic_max_ranks: 2}").replace(
        "  controller:\n", "  controller:\n    averaging: nccl_sync\n"
    ))
    with pytest.raises(ConfigError, match=r"join\.elastic_max_ranks .* needs a CPU averaging mode"):
        options_from_args(parse("--config", str(tmp_path / "fdl.yml")))
