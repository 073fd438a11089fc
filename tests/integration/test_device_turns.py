"""Turns on one device shared by several processes (the sync-pool baseline's simulated device), on real Redis:
one holder at a time, a waiter woken by the release rather than by polling, and a dead holder's turn expiring."""

from __future__ import annotations

import itertools
import threading
import time
import uuid

import redis

from stoker.adapters.store.coordination import DeviceTurns
from workers.procs import wait_for


def test_turns_never_overlap_and_a_waiter_is_woken_by_the_release(store_redis: redis.Redis[bytes]) -> None:
    key = f"stoker:test:device:{uuid.uuid4().hex}"
    # A recheck far beyond the test's waits: a waiter that got its turn was woken by a release, not by polling.
    turns = DeviceTurns(store_redis, key, hold_s=30, recheck_s=120)
    spans: list[tuple[float, float]] = []
    holding = threading.Event()

    def use(hold: threading.Event | None = None) -> None:
        with turns.turn():
            start = time.monotonic()
            if hold is not None:
                holding.set()
                hold.wait(10)
            spans.append((start, time.monotonic()))

    release = threading.Event()
    first = threading.Thread(target=use, args=(release,))
    first.start()
    assert holding.wait(10)
    waiters = [threading.Thread(target=use) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    release.set()
    for thread in (first, *waiters):
        thread.join(30)
    assert not any(t.is_alive() for t in (first, *waiters)), "a waiter was not woken by the turns before it"
    spans.sort()
    assert len(spans) == 4
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))


def test_a_turn_whose_holder_died_expires_and_the_next_waiter_gets_the_device(store_redis: redis.Redis[bytes]) -> None:
    key = f"stoker:test:device:{uuid.uuid4().hex}"
    dead = store_redis.lock(key, timeout=1, thread_local=False)
    assert dead.acquire(blocking=False)  # taken and never released: its process died
    turns = DeviceTurns(store_redis, key, hold_s=30, recheck_s=0.2)
    served = threading.Event()

    def use() -> None:
        with turns.turn():
            served.set()

    waiter = threading.Thread(target=use)
    waiter.start()
    wait_for(served.is_set, 20, "the waiter's turn after the dead holder's lapsed", [])
    waiter.join(10)
    assert not store_redis.exists(key)  # given up after its turn
