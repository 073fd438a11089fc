"""`stoker reaper`: the process that moves late and stalled jobs on. Run one or more; one acts at a time."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from types import FrameType

import redis

from stoker.adapters.store.coordination import give_up_lease
from stoker.adapters.store.keys import REAPER_LEASE_KEY
from stoker.core.pacing import Pace
from stoker.runtime.context import WorkerContext
from stoker.runtime.reaping import dispatch_callbacks, lift_aged, reap_once, recover_lost
from stoker.settings import WorkerSettings
from tasks.app import make_app
from tasks.pipeline import CeleryOutbox

log = logging.getLogger(__name__)


def run_reaper() -> int:
    """Take the reaper lease (or wait for it) and reap every interval until SIGTERM or SIGINT."""
    settings = WorkerSettings()
    ctx = WorkerContext(settings, CeleryOutbox(make_app(settings), settings.video_keyframes))
    try:
        return _reap_until_stopped(ctx)
    finally:
        ctx.close()


def _reap_until_stopped(ctx: WorkerContext) -> int:
    """The reaper's loop: lease, reap, beat, until told to stop. Every `reaper_interval_s` while any job is in
    flight; while none is, it slows down to `idle_max_wait_s` (a job accepted meanwhile is looked at within that)."""
    settings, store = ctx.settings, ctx.store
    stopping = threading.Event()

    def stop(signum: int, _: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    ctx.pipeline_context()  # a cut-off tokenizes at once: load the tokenizer now
    token = f"{socket.gethostname()}:{os.getpid()}"
    pace = Pace(settings.reaper_interval_s, settings.idle_max_wait_s)
    lease_s = max(settings.reaper_interval_s * 8, pace.max_s * 3, 2.0)  # never lapses between two rounds
    log.info("reaper %s ready (every %.2fs)", token, settings.reaper_interval_s)
    leading = False
    while not stopping.is_set():
        active = False
        try:
            held = store.leases.take_lease(REAPER_LEASE_KEY, token, lease_s)
            if held != leading:
                log.info("reaper %s %s the lease", token, "holds" if held else "lost")
                leading = held
            if held:
                in_flight = store.watch.watching() > 0
                done = reap_once(ctx) + recover_lost(ctx) + dispatch_callbacks(ctx)
                if in_flight:  # every stage message is an accepted job's: with none in flight, none waits to lift
                    done += lift_aged(ctx)
                if set(done) - {"wait"}:
                    log.info("reaped: %s", dict(done))
                active = bool(done) or in_flight
        except redis.RedisError as exc:
            log.warning("reaper cannot reach the store: %s", exc)
        settings.reaper_heartbeat.touch()
        stopping.wait(pace.next_wait(active))
    if leading:
        give_up_lease(settings, REAPER_LEASE_KEY, token)
    log.info("reaper %s stopped", token)
    return 0
