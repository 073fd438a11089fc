"""A simulated accelerator behind the inference queue, for benchmarks and tests: nothing here is a model."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from stoker.adapters.backends.calls import YieldsToConsumer, stops_now
from stoker.core.model import Continued, ModelRequest, Prediction

log = logging.getLogger(__name__)


class SimPredictor(YieldsToConsumer):
    """A simulated accelerator, for benchmarks and tests: a batch takes `base_ms + per_item_ms × items`.

    The time is spent asleep, so the device is busy while the CPU stays free, as with a real GPU. The answers are
    placeholders saying what was simulated: nothing here is a model.

    With `steps`, each request is that many decoding steps, and a call of n requests spends `(base_ms + per_item_ms
    × n) / steps` on each: run whole, a batch takes what it took without steps. Given a consumer to yield to
    (`yield_to`), a call stops every `yield_steps` steps when some of its answers are done and others are not, or
    when a request waits for the device and the call has room for it, as `TransformersPredictor`'s calls do: the
    unfinished answers come back `Continued` (their steps so far) and go on in the next call beside the waiting
    requests. Batch lines run to their end.
    """

    mixes_sampling = True

    def __init__(
        self,
        base_ms: float,
        per_item_ms: float,
        name: str = "sim",
        fault: str = "none",
        steps: int = 0,
        yield_steps: int = 0,
    ) -> None:
        self.base_ms = base_ms
        self.per_item_ms = per_item_ms
        self.name = name
        #: `raise`: every call fails; `short`: one answer fewer than requests (tests of the consumer's guards).
        self.fault = fault
        self.steps = steps
        self.yield_steps = yield_steps

    def setup(self, device: str) -> None:
        """Nothing to load."""
        log.info("simulated device: %.1f ms + %.1f ms per item", self.base_ms, self.per_item_ms)

    def batch(self, requests: Sequence[ModelRequest]) -> SimBatch:
        """Each request's prompt length and the steps its answer has had; whether the call may stop early."""
        yields = bool(self.steps and self.yield_steps and self._waiting) and not any(r.background for r in requests)
        return SimBatch([len(r.prompt_ids) for r in requests], [len(r.generated) for r in requests], yields)

    def predict(self, batch: SimBatch) -> SimBatch:
        """Keep the simulated device busy for this call's time: the whole batch's, or its steps' until it yields."""
        if self.steps:
            ran = replace(batch, done=self._step(batch))
        else:
            time.sleep((self.base_ms + self.per_item_ms * len(batch.prompts)) / 1000)
            ran = batch
        if self.fault == "raise":
            raise RuntimeError("simulated device fault")
        return replace(ran, prompts=ran.prompts[:-1]) if self.fault == "short" else ran

    def _step(self, batch: SimBatch) -> list[int]:
        """Run the call's steps until its answers are done or it yields (see the class); each row's steps after."""
        rows = len(batch.prompts)
        step_s = (self.base_ms + self.per_item_ms * rows) / self.steps / 1000
        if not batch.yields:  # one sleep for the whole call: the same time, without a sleep's overshoot per step
            time.sleep((self.steps - min(batch.done)) * step_s)
            return [self.steps] * rows
        done, taken = list(batch.done), 0
        while min(done) < self.steps:
            time.sleep(step_s)
            taken += 1
            done = [min(d + 1, self.steps) for d in done]
            going = sum(d < self.steps for d in done)
            if (
                taken % self.yield_steps == 0
                and self._waiting
                and stops_now(going, rows, self._max_rows, self._waiting)
            ):
                break
        return done

    def unbatch(self, output: SimBatch) -> list[Prediction | Continued]:
        """One placeholder answer per request; with steps, an unfinished one comes back `Continued`."""
        outcomes: list[Prediction | Continued] = []
        for n, steps in zip(output.prompts, output.done, strict=False):  # `short` drops a prompt, not its steps
            if self.steps and steps < self.steps:
                outcomes.append(Continued(tuple([0] * steps)))
            else:
                text = f"[sim] batch of {len(output.prompts)}, {n} prompt tokens"
                outcomes.append(Prediction(text=text, prompt_tokens=n, completion_tokens=self.steps))
        return outcomes


@dataclass(frozen=True)
class SimBatch:
    """A simulated call: each request's prompt length and its answer's steps so far; whether it may yield."""

    prompts: list[int]
    done: list[int]
    yields: bool = False
