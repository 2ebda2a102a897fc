"""The cyclic collector under thousands of linked hosts: freeze what the process holds every
`FREEZE_EVERY` admissions and space the full collections while `STORM_LINKS` hosts are linked; all of it
handed back when the last link ends (`link_opened` / `link_ended`, called by the join channel).
"""

from __future__ import annotations

import gc

# Thousands of linked hosts are thousands of long-lived objects (stream, connection, task, buffers per
# link); the collector's full collections rescan all of them each time the heap grows by a quarter: at
# 10,000 joining hosts eight full collections took ~3.9 s of the controller's time, the longest 1.6 s
# (a stall every poller and joiner waited behind). Every FREEZE_EVERY admissions, what the process holds is
# moved out of the collector's generations (`gc.freeze`, O(1)); when the last link of the process closes,
# it is all handed back (`gc.unfreeze`) and the next full collection reclaims whatever cycles the run left.
# A process that never links that many hosts at once never freezes anything here.
FREEZE_EVERY = 1024
# What the full collections of a storm still scan is mostly the dials in flight (~40 tracked objects each:
# ~100,000 objects with 2,500 connections in their handshake, 30-70 ms of CPU per collection, collecting
# nothing). While STORM_LINKS hosts or more are linked, the oldest generation is collected
# FULL_COLLECTION_SPACING times less often (its threshold multiplied); restored when the last link ends.
STORM_LINKS = 256
FULL_COLLECTION_SPACING = 10


class LinkedHeap:
    """The process's count of linked hosts and what a storm changed in the collector (one per process)."""

    linked = 0
    admitted_since_freeze = 0
    froze = False
    thresholds: tuple[int, ...] | None = None
    """The collector's thresholds before a storm spaced its full collections; None outside one."""


def link_opened() -> None:
    LinkedHeap.linked += 1
    LinkedHeap.admitted_since_freeze += 1
    if LinkedHeap.linked >= STORM_LINKS and LinkedHeap.thresholds is None:
        LinkedHeap.thresholds = thresholds = gc.get_threshold()
        if len(thresholds) == 3:
            gc.set_threshold(thresholds[0], thresholds[1], thresholds[2] * FULL_COLLECTION_SPACING)
    if LinkedHeap.admitted_since_freeze >= FREEZE_EVERY:
        LinkedHeap.admitted_since_freeze = 0
        LinkedHeap.froze = True
        gc.freeze()


def link_ended() -> None:
    LinkedHeap.linked -= 1
    if LinkedHeap.linked <= 0:
        LinkedHeap.linked = 0
        LinkedHeap.admitted_since_freeze = 0
        if LinkedHeap.thresholds is not None:
            gc.set_threshold(*LinkedHeap.thresholds)
            LinkedHeap.thresholds = None
        if LinkedHeap.froze:
            LinkedHeap.froze = False
            gc.unfreeze()
