"""Abuse of the join channel on a real daemon.

Every refusal is silent or a Reject, counted, and the daemon serves on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random

import pytest

from flodld.config.join import JoinConfig
from flodld.controller.run import Controller
from flodld.wire.frames import FRAME_MAGIC, HEADER, PREAUTH_MAX_PAYLOAD, PROTOCOL_VERSION
from flodld.wire.join import Accept, Hello, Reject
from flodld.wire.messages import encode_message
from flodld.wire.salt import OPEN_ADMISSION_KEY, new_salt, salt_to_hex

from .daemon import CLOSE_BOUND_SECS, RawJoin, hello, options, raw_join, running, state, state_until


async def _legit_join(port: int, key: bytes, host: str) -> RawJoin:
    """Join and stay: the caller closes the link (closing before formation retracts the host)."""
    client = await raw_join(port, key)
    client.write(client.conn.send_message(hello(host)))
    reply = await client.next_message()
    assert isinstance(reply, Accept), reply
    return client


@pytest.mark.parametrize("who", ["wrong_token", "missing_token", "token_of_another_run"])
async def test_a_join_not_keyed_with_the_run_salt_gets_no_reply_and_is_counted(who: str) -> None:
    other_run = Controller(options(run_id="another-run")).salt  # a second run's own salt
    async with running() as (controller, port):
        assert other_run != controller.salt
        key = {
            "wrong_token": new_salt(),
            "missing_token": OPEN_ADMISSION_KEY,
            "token_of_another_run": other_run,
        }[who]
        client = await raw_join(port, key)
        client.write(client.conn.send_message(hello("intruder")))
        loop = asyncio.get_running_loop()
        begun = loop.time()
        answered = await client.read_until_closed()
        assert answered == b"", "an unauthenticated hello must not be answered"
        assert loop.time() - begun < CLOSE_BOUND_SECS
        body = await state_until(port, lambda b: b["refused"].get("bad_tag") == 1)
        assert body["refused"].get("bad_tag") == 1
        assert body["joined_hosts"] == 0
        legit = await _legit_join(port, controller.salt, "legit")
        assert (await state_until(port, lambda b: b["joined_hosts"] == 1))["joined_hosts"] == 1
        legit.close()


async def test_a_replayed_join_from_a_peer_that_knows_the_salt_is_refused() -> None:
    async with running() as (controller, port):
        first = await raw_join(port, controller.salt)
        first.write(first.conn.send_message(hello("victim")))
        assert isinstance(await first.next_message(), Accept)
        captured = bytes(first.sent)
        first.close()
        await asyncio.sleep(0.1)  # the victim leaves: its host name is free again
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(captured)  # magic, the old nonce, the old authenticated hello: byte for byte
        async with asyncio.timeout(CLOSE_BOUND_SECS):
            reply = await reader.read(-1)
        writer.close()
        assert len(reply) == 16, "the daemon answers the replay with its fresh nonce and nothing else"
        body = await state_until(port, lambda b: b["refused"].get("bad_tag") == 1)
        assert body["refused"].get("bad_tag") == 1
        assert all(m["host"] != "victim" or m["link"] != "open" for m in body["members"])


async def test_open_admission_key_on_a_preshared_run_cannot_join_even_knowing_the_protocol() -> None:
    async with running() as (controller, port):
        assert controller.join_key == controller.salt
        client = await raw_join(port, OPEN_ADMISSION_KEY)
        client.write(client.conn.send_message(hello("walk-in")))
        assert await client.read_until_closed() == b""
        assert (await state_until(port, lambda b: b["refused"] == {"bad_tag": 1}))["refused"] == {
            "bad_tag": 1
        }


async def test_frames_after_an_open_admission_accept_must_use_the_handed_out_salt() -> None:
    opts = options(
        bind_host="0.0.0.0",
        join=JoinConfig(join_timeout=60, target_ranks=8, min_rank_start=1, open_admission=True),
    )
    async with running(opts) as (controller, port):
        client = await raw_join(port, OPEN_ADMISSION_KEY)
        client.write(client.conn.send_message(hello("walk-in")))
        accept = await client.next_message()
        assert isinstance(accept, Accept) and accept.salt_hex == controller.salt_hex
        # Still speaking the public key after Accept: the controller has rekeyed, so this is forged.
        from flodld.wire.join import RankExited

        client.write(client.conn.send_message(RankExited(rank=0, code=0)))
        await client.read_until_closed()
        body = await state_until(port, lambda b: "walk-in" not in [m["host"] for m in b["members"]])
        assert "walk-in" not in [m["host"] for m in body["members"]]  # link dropped, ranks retracted
        assert body["rank_exits"] == []


def _mutated_hellos(seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    good = json.loads(encode_message(hello("fuzz"))[1])
    absurd = [
        None,
        -1,
        2**70,
        "",
        "h" * 300,
        "a b",
        ["cpu:0"] * 5000,
        ["cuda:0", "cpu:0"],
        [f"cpu:{i}" for i in range(300)],
        {"x": 1},
        1.5,
        "\u0000",
        65536,
        "ab" * 32,
        "zz",
    ]
    payloads = []
    for _ in range(count):
        mutated = dict(good)
        for _ in range(rng.randint(1, 3)):
            mutated[rng.choice([*good, "extra"])] = rng.choice(absurd)
        payloads.append(json.dumps(mutated).encode())
    payloads += [b"", b"\xff\xfe", b"[" * 10000, b'{"host":"a"}' + b" " * 1000, b"null"]
    return payloads


async def test_fuzzed_hellos_get_a_reject_with_a_code_and_never_stop_the_daemon() -> None:
    async with running() as (controller, port):
        codes: list[str] = []
        oversized = 0
        for payload in _mutated_hellos(seed=7, count=40):
            client = await raw_join(port, controller.salt)
            client.write(client.conn.send_frame(Hello.KIND, payload))
            try:
                reply = await client.next_message()
            except EOFError:
                if len(payload) > PREAUTH_MAX_PAYLOAD:  # a first frame over the small caps is refused unread
                    oversized += 1
                    client.close()
                    continue
                raise AssertionError(f"no reply to an authenticated hello {payload[:80]!r}") from None
            client.close()
            if isinstance(reply, Accept):
                continue  # the mutation happened to be a valid hello
            assert isinstance(reply, Reject), reply
            assert reply.reason and reply.code
            assert controller.salt_hex not in reply.reason
            codes.append(reply.code)
        body = await state(port)
        assert sum(body["refused"].values()) == len(codes) + oversized
        # An oversized first frame is refused from its header, or (arriving in one burst) at the allowance.
        overs = body["refused"].get("too_large", 0) + body["refused"].get("connection_preauth_overrun", 0)
        assert overs == oversized + codes.count("too_large")
        assert "bad_payload" in codes
        (await _legit_join(port, controller.salt, "after-the-storm")).close()


@pytest.mark.parametrize(
    ("payload_len", "tail_len", "code"),
    [
        (2**20 + 1, 0, "too_large"),
        (2**32 - 1, 0, "too_large"),
        (0, 1, "too_large"),
        (16, 2**32 - 1, "too_large"),
    ],
)
async def test_an_oversized_length_field_is_refused_from_the_header(
    payload_len: int, tail_len: int, code: str
) -> None:
    async with running() as (controller, port):
        client = await raw_join(port, controller.salt)
        client.write(HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, Hello.KIND, 0, payload_len, tail_len))
        assert await client.read_until_closed() == b""
        assert (await state_until(port, lambda b: b["refused"] == {code: 1}))["refused"] == {code: 1}


@pytest.mark.parametrize(
    ("header", "code"),
    [
        (HEADER.pack(0xDEADBEEF, PROTOCOL_VERSION, Hello.KIND, 0, 2, 0), "bad_magic"),
        (HEADER.pack(FRAME_MAGIC, 1, Hello.KIND, 0, 2, 0), "bad_version"),
        (HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, Hello.KIND, 0, 2, 0), "bad_tag"),
        (HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, Hello.KIND, 0, 2, 0)[:10], "truncated"),
    ],
    ids=["wrong-magic", "wrong-version", "forged-tag", "truncated"],
)
async def test_malformed_join_frames_are_dropped_and_counted_by_reason(header: bytes, code: str) -> None:
    async with running() as (controller, port):
        client = await raw_join(port, controller.salt)
        client.write(header + b"{}" + bytes(16))
        if code == "truncated":
            client.writer.write_eof()
        assert await client.read_until_closed() == b""
        assert (await state_until(port, lambda b: b["refused"] == {code: 1}))["refused"] == {code: 1}


async def test_a_second_hello_on_an_admitted_link_adds_no_ranks_and_a_replayed_frame_drops_the_link() -> None:
    async with running() as (controller, port):
        client = await raw_join(port, controller.salt)
        client.write(client.conn.send_message(hello("dup", devices=2)))
        assert isinstance(await client.next_message(), Accept)
        first_hello_frame = bytes(client.sent[20:])
        client.write(client.conn.send_message(hello("dup2", devices=4)))
        body = await state_until(port, lambda b: b["joined_ranks"] == 2)
        assert body["joined_ranks"] == 2 and [m["host"] for m in body["members"]] == ["dup"]
        client.write(first_hello_frame)  # seq 0 again on the same connection: `replay`
        assert await client.read_until_closed() == b""
        body = await state_until(port, lambda b: b["joined_ranks"] == 0)
        assert body["joined_ranks"] == 0 and body["members"] == []


async def test_the_salt_never_appears_in_replies_logs_or_state(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with running() as (controller, port):
        secret_hex = controller.salt_hex
        transcripts: list[bytes] = []
        for key in (new_salt(), OPEN_ADMISSION_KEY, controller.salt):
            client = await raw_join(port, key)
            client.write(client.conn.send_message(hello("x" if key != controller.salt else "y")))
            client.write(client.conn.send_frame(0xFFFF, b"\xff"))
            if key == controller.salt:
                await client.next_message()  # the Accept
                await asyncio.sleep(0.1)
                client.close()
            else:
                await client.read_until_closed()
            transcripts.append(bytes(client.received))
        text = json.dumps(await state(port))
    for blob in (*transcripts, text.encode(), caplog.text.encode()):
        assert secret_hex.encode() not in blob.lower()
        assert controller.salt not in blob
    assert secret_hex.upper().encode() not in caplog.text.encode()
    assert salt_to_hex(controller.salt) not in caplog.text
