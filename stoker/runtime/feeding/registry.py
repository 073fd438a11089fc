"""The consumer in the store's registry of consumers: its name, the jobs it holds and lets go of, and its leaving.
The reaper sends again the jobs of a consumer whose beats lapsed."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Sequence
from functools import partial

from stoker.adapters.store.jobs import Queued
from stoker.runtime.context import WorkerContext
from stoker.runtime.feeding.messages import job_of
from stoker.runtime.seams import Message

log = logging.getLogger(__name__)


class Registry:
    """This consumer's entry in the store: each write is best effort (the broker's redelivery and the reaper cover
    a lost one)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.consumer = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"

    def beat(self, ttl_s: float) -> None:
        """This consumer lives for `ttl_s` more (raises while the store is away)."""
        self.ctx.store.consumers.beat(self.consumer, ttl_s=ttl_s)

    def hold(self, job_ids: list[str]) -> None:
        """The jobs are named as held, in a round trip of their own."""
        try:
            self.ctx.store.consumers.hold(self.consumer, job_ids)
        except Exception as exc:  # the store is away: the broker's own redelivery still covers these
            log.warning("could not record held jobs: %s", exc)

    def queue_hold(self, job_ids: Sequence[str]) -> Queued:
        """The naming of the jobs as held, for a round trip under way."""
        return partial(self.ctx.store.consumers.queue_hold, consumer=self.consumer, job_ids=list(job_ids))

    def release(self, job_ids: list[str]) -> None:
        """The jobs are no longer held."""
        try:
            self.ctx.store.consumers.release(self.consumer, job_ids)
        except Exception as exc:  # a stale entry only makes the reaper look at an ended job, and forget it
            log.warning("could not release held jobs: %s", exc)

    def done_with(self, message: Message) -> None:
        """A message with nothing left to do: counted as drained, acked, no longer held."""
        try:
            self.ctx.store.stats.count_drained("infer")
        finally:
            message.acknowledge()
            self.release([job_of(message)])

    def leave(self) -> None:
        """The consumer goes: its entry with it."""
        self.ctx.store.consumers.leave(self.consumer)
