"""`FoldLoad`: one load of the fold per shell, awaited by the first fold, started again after a failure.

The real load (torch) runs once per process, so these tests stand a counting stand-in for `load_fold` and
`fold_loaded` in `flodld.relay.foldload`; the real import off the loop is `test_relay_preload.py`'s.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from flodld.relay import foldload
from flodld.relay.foldload import FoldLoad


class FakeFold:
    """`load_fold` and `fold_loaded` for one test: fails the first `failures` loads, counts every load and
    the threads they ran in.
    """

    def __init__(self, failures: int = 0, gate: threading.Event | None = None) -> None:
        self.failures = failures
        self.loads = 0
        self.loaded = False
        self.threads: set[int] = set()
        self.gate = gate

    def load(self) -> None:
        self.loads += 1
        self.threads.add(threading.get_ident())
        if self.gate is not None:
            self.gate.wait(5)
        if self.loads <= self.failures:
            raise ImportError(f"load {self.loads} failed")
        self.loaded = True


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> FakeFold:
    fold = FakeFold(**getattr(request, "param", {}))
    monkeypatch.setattr(foldload, "load_fold", fold.load)
    monkeypatch.setattr(foldload, "fold_loaded", lambda: fold.loaded)
    return fold


async def test_start_then_ready_loads_once_off_the_loop(
    fake: FakeFold, caplog: pytest.LogCaptureFixture
) -> None:
    fake.gate = threading.Event()
    load = FoldLoad(loaded_level=logging.INFO)  # the controller's data plane
    with caplog.at_level(logging.INFO, logger="flodld.fold.load"):
        load.start()
        load.start()  # a second start while loading starts nothing
        waiting = asyncio.create_task(load.ready())
        await asyncio.sleep(0.05)
        assert not waiting.done()  # the loop turns while the load runs
        fake.gate.set()
        await asyncio.wait_for(waiting, 5)
        await load.ready()  # loaded: returns at once
    assert fake.loads == 1
    assert threading.get_ident() not in fake.threads
    assert any("event=fold_loaded" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("fake", [{"failures": 1}], indirect=True)
async def test_a_failed_load_is_a_warning_and_the_next_ready_loads_again(
    fake: FakeFold, caplog: pytest.LogCaptureFixture
) -> None:
    load = FoldLoad()
    with caplog.at_level(logging.INFO, logger="flodld.fold.load"):
        with pytest.raises(ImportError, match="load 1 failed"):
            await load.ready()  # the round that needed the fold fails with the load's error
        await asyncio.sleep(0)  # the done callback runs
        await load.ready()
    assert fake.loads == 2 and fake.loaded
    # A relay's (the default): the failure is a warning; the success stays out of the operator's terminal.
    messages = [(record.levelno, record.getMessage()) for record in caplog.records]
    assert any(
        level == logging.WARNING and "event=fold_load_failed" in message and "load 1 failed" in message
        for level, message in messages
    ), messages
    assert not any("event=fold_loaded" in message for _, message in messages), messages


@pytest.mark.parametrize("fake", [{"failures": 10}], indirect=True)
async def test_a_load_that_keeps_failing_fails_every_ready_and_never_hangs(fake: FakeFold) -> None:
    load = FoldLoad()
    for attempt in range(1, 4):
        with pytest.raises(ImportError, match=f"load {attempt} failed"):
            await asyncio.wait_for(load.ready(), 5)
    assert fake.loads == 3


async def test_once_loaded_in_this_process_nothing_starts(fake: FakeFold) -> None:
    fake.loaded = True  # another shell of this process loaded it
    load = FoldLoad()
    load.start()
    await load.ready()
    assert fake.loads == 0
