"""The model behind the inference queue, as a hook contract: setup(device), then batch → predict → unbatch."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

from stoker.adapters.backends.calls import (
    EngineRun,
    LocalBatch,
    YieldsToConsumer,
    stops_now,
    submit_in_turn,
    torch_dtype,
    with_calls,
)
from stoker.adapters.backends.engine import DecodeEngine
from stoker.adapters.backends.engine_rows import EngineRequest, Finished, Row
from stoker.adapters.backends.generation import (
    Generated,
    RowDraws,
    RowSampler,
    Step,
    StopSequences,
    YieldPoints,
    step_logprobs,
)
from stoker.adapters.backends.grammar import GrammarMask, grammar_for, token_grammar
from stoker.adapters.backends.streams import Pieces, RowStreams, StreamedRow, send_piece
from stoker.adapters.backends.tokenizer import load_tokenizer
from stoker.core.batching import collate_left, strip_generated
from stoker.core.errors import InferenceFailed
from stoker.core.model import Continued, ModelRequest, Outcome, Prediction, apply_stop
from stoker.core.streaming import TextStream

log = logging.getLogger(__name__)


class TransformersPredictor(YieldsToConsumer):
    """A local Hugging Face causal LM: batched generate with left padding, greedy unless a request samples.

    One generate call takes one temperature / top_p / seed (`mixes_sampling` is False: the consumer groups a batch
    by them); a sampled row draws its tokens from a stream of its own (`RowSampler`), so a seeded answer is the
    same whatever shares its call and however often the call yields. Requests of a call may differ in
    `max_tokens` (the call runs to the largest, each row is cut to its own), in stop sequences (a row ends at the
    token that completes one: `StopSequences`), in the grammar their answer must follow (`response_format`, forced
    tool calls: `grammar.GrammarMask`; a row that breaks its grammar is ended and its request fails alone), and in being
    streamed (`streams.RowStreams`, given `pieces`). An answer of a request with tools is streamed as the model
    writes it, its calls' markup with it (the API reads the pieces for calls: `stoker.core.tool_stream`), and is
    parsed for its calls once complete.

    Given a consumer to yield to (`yield_to`), a call of interactive requests stops between decoding steps, every
    `yield_tokens` new tokens, when some of its answers are done and others are not, or when a request waits for
    the device and the call has room for it (`YieldPoints`): the done answers are written, the others come back
    `Continued` and go on in the next call beside the requests that waited, their prompts re-read with the tokens
    they have (iteration-level scheduling at a granularity of `yield_tokens`, for a model behind `generate`, which
    cannot take new rows into a running call). Calls with `n` above 1 or `logprobs`, and batch lines, run to their
    end.
    """

    mixes_sampling = False

    def __init__(
        self,
        model_path: str,
        *,
        max_new_tokens: int,
        dtype: str = "auto",
        name: str = "",
        vram_budget_gb: float | None = None,
        max_tokens_cap: int | None = None,
        max_context_tokens: int | None = None,
        pieces: Pieces | None = None,
        yield_tokens: int = 0,
        threads: int = 0,
        engine: bool = True,
        max_rows: int = 0,
        kv_cache_tokens: int = 0,
        prefill_chunk: int = 0,
    ) -> None:
        self.model_path = model_path
        #: Whether calls run on the decode engine (every row's KV cache kept across steps and calls), or on
        #: `generate` (the restart-based path: a call that yields is started again, its prompts re-read).
        self.engine = engine
        #: The engine's room: rows at once (0: the consumer's batch size), cache tokens in all (0: unbounded).
        self.max_rows = max_rows
        self.kv_cache_tokens = kv_cache_tokens
        #: Prompt tokens the engine reads at most in a step while rows generate (0: a joining prompt whole).
        self.prefill_chunk = prefill_chunk
        #: The engine samples, masks and stops each row by its own request: one call mixes any of them.
        self.mixes_sampling = engine
        self._engine: DecodeEngine | None = None
        #: CPU threads for torch's operations (0: torch's default).
        self.threads = threads
        self.pieces = pieces
        self.yield_tokens = yield_tokens
        #: Prompt and answer together at most (an answer stops where the context is full).
        self.max_context_tokens = max_context_tokens
        self.max_new_tokens = max_new_tokens
        self.max_tokens_cap = max_tokens_cap or max_new_tokens
        self.dtype = dtype
        self.name = name or model_path
        self.vram_budget_gb = vram_budget_gb
        self._model: Any = None
        self._tokenizer: Any = None
        self._grammar_tokenizer: Any = None
        self._device = "cpu"

    def setup(self, device: str) -> None:
        """Load tokenizer and weights (safetensors) onto device."""
        # heavy (torch, transformers): loaded by setup(), never at import
        import torch

        started = time.perf_counter()
        self._device = device
        if self.threads:
            torch.set_num_threads(self.threads)  # the process's intra-op pool: the model is all it runs
        if device.startswith("cuda") and self.vram_budget_gb:
            self._cap_vram(torch, device, self.vram_budget_gb)
        self._tokenizer = load_tokenizer(self.model_path)  # as the prompts were built: the same ids
        self._model = self._load_model(device)
        log.info("model %s on %s loaded in %.1fs", self.name, device, time.perf_counter() - started)

    def _load_model(self, device: str) -> Any:
        """The causal LM's weights, on device, in inference mode."""
        import torch  # heavy: see setup()
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch_dtype(torch, self.dtype, device))
        return model.to(device).eval()

    @staticmethod
    def _cap_vram(torch: Any, device: str, budget_gb: float) -> None:
        """Keep this process within budget_gb of the GPU's memory (the rest stays free for other tenants)."""
        index = torch.device(device).index or 0
        total = torch.cuda.get_device_properties(index).total_memory
        fraction = min(budget_gb * 1024**3 / total, 1.0)
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        log.info("VRAM capped at %.1f GiB (%.0f%% of %s)", budget_gb, fraction * 100, device)

    @property
    def pad_id(self) -> int:
        """Padding token id (falls back to end-of-sequence)."""
        tok = self._tokenizer
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

    def batch(self, requests: Sequence[ModelRequest]) -> LocalBatch:
        """Left-pad the prompts (with any answer so far) so generation starts at the same column for all."""
        collated = collate_left([[*r.prompt_ids, *r.generated] for r in requests], self.pad_id)
        return LocalBatch(collated, list(requests))

    def predict(self, batch: LocalBatch) -> Generated | EngineRun:
        """The batch on the decode engine (`_run_engine`); without it, one generate call for the whole batch, as
        long as its longest-asking request needs: each prompt's row repeated for its `n` answers (the call's
        requests share `n` and `logprobs`: they are in the sampling key), and with `logprobs` each step's raw
        logits kept for the answers' log probabilities."""
        if self.engine:
            return self._run_engine(batch)
        return self._generate(batch)

    def _run_engine(self, batch: LocalBatch, features: Sequence[Sequence[Any]] = ()) -> EngineRun:
        """Step the engine over the batch's requests (each joins as room frees) until every answer is done, or,
        given a consumer to yield to, every `yield_tokens` steps when some answers are done and others are not or
        a request waits for the device and the engine has room: the answers still going are parked with their
        caches (`DecodeEngine.park`) and come back `Continued`, to go on from their caches in the next call. A call
        never stops while prompts of its are being read (chunked prefill): they would be read again."""
        engine = self._decode_engine(len(batch.requests))
        queued = [self._engine_request(i, r, features[i] if features else ()) for i, r in enumerate(batch.requests)]
        finished: dict[int, Finished] = {}
        steps, every = 0, self._yield_every(batch)
        try:
            while queued or engine.busy:
                queued = submit_in_turn(engine, queued)
                self._drop_cancelled(engine, batch, finished)
                finished.update((int(f.key), f) for f in engine.step())  # type: ignore[call-overload]
                steps += 1
                may_stop = every and steps % every == 0 and not engine.reading
                if may_stop and self._yields(engine, len(batch.requests) - len(finished), batch):
                    break
            going = {i: engine.park(i) for i in range(len(batch.requests)) if i not in finished}
        except BaseException:
            self._engine = None  # rows of a call that broke never go on: the next call starts a fresh engine
            raise
        return EngineRun(batch, finished, going)

    def _drop_cancelled(self, engine: DecodeEngine, batch: LocalBatch, finished: Collection[int]) -> None:
        """Drop the rows of each request whose job was cancelled since the call began: it leaves at the next step
        (its answer is not written: the job ended), the others go on."""
        cancelled = self._cancelled
        if cancelled is None:
            return
        for i, request in enumerate(batch.requests):
            if i not in finished and request.job_id and cancelled(request.job_id):
                engine.cancel(i)

    @property
    def tokens_fed(self) -> int:
        """Tokens the decode engine has fed the model (prompts and answers; 0 before its first call)."""
        return self._engine.fed if self._engine is not None else 0

    def _yield_every(self, batch: LocalBatch) -> int:
        """How many steps apart the engine may stop for the consumer (0: it runs to the end). An answer with `n`
        above 1 or `logprobs`, or a batch line, runs to its end: `Continued` carries neither."""
        lines = any(r.background for r in batch.requests)
        if self._waiting is None or lines or any(p.n > 1 or p.logprobs for p in batch.params):
            return 0
        return self.yield_tokens

    def _yields(self, engine: DecodeEngine, going: int, batch: LocalBatch) -> bool:
        assert self._waiting is not None
        return stops_now(going, len(batch.requests), min(self._max_rows, engine.max_rows), self._waiting)

    def _decode_engine(self, size: int) -> DecodeEngine:
        """The engine (made at the first call); its room is `max_rows`, else the consumer's batch size (or this
        call's, when larger: between calls no row runs, so its room may change)."""
        rows = self.max_rows or max(self._max_rows, size)
        if self._engine is None:
            end = int(self._tokenizer.eos_token_id)
            self._engine = DecodeEngine(
                self._model,
                self._decode,
                self._stop_ids(),
                max_rows=rows,
                device=self._device,
                grammar_tokenizer=self._token_grammar,
                end=end,
                max_tokens=self.kv_cache_tokens or None,
                prefill_chunk=self.prefill_chunk,
            )
        self._engine.pieces, self._engine.max_rows = self.pieces, rows
        return self._engine

    def _token_grammar(self) -> Any:
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = token_grammar(self._tokenizer)
        return self._grammar_tokenizer

    def _engine_request(self, key: int, request: ModelRequest, features: Sequence[Any]) -> EngineRequest:
        """A request as the engine takes it."""
        return EngineRequest(
            key,
            request.prompt_ids,
            request.params,
            limit=self._limit(request),
            generated=request.generated,
            grammar=grammar_for(request.params),
            stream_to=request.stream_to,
            sent=request.sent,
            features=features,
            images=tuple(request.images),
        )

    def _generate(self, batch: LocalBatch, **inputs: Any) -> Generated:
        """The model's generate over the left-padded batch (with any further model inputs): every row's ids, with
        `logprobs` each row's steps, and the rows it streamed."""
        import torch  # heavy: see setup()
        from transformers import LogitsProcessorList, StoppingCriteriaList

        first = batch.params[0]
        ids = torch.tensor(batch.collated.input_ids, device=self._device).repeat_interleave(first.n, dim=0)
        mask = torch.tensor(batch.collated.attention_mask, device=self._device).repeat_interleave(first.n, dim=0)
        streams, grammars, stops = self._streams(batch), self._grammars(batch), self._stop_sequences(batch)
        if grammars is not None and stops is not None:
            grammars.ended = stops.done  # a row its stop ended is padded from then on: not text its grammar reads
        # after the grammars: a sampled row draws among the tokens its grammar allows; generate then takes the one
        # drawn as its greedy choice
        hooks = [hook for hook in (grammars, self._sampler(batch), streams) if hook is not None]
        rest = [self._limit(r) - len(r.generated) for r in batch.requests]
        with torch.inference_mode():
            out = self._model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(rest),
                pad_token_id=self.pad_id,
                return_dict_in_generate=True,
                output_logits=first.logprobs,
                logits_processor=LogitsProcessorList(hooks),
                stopping_criteria=StoppingCriteriaList(
                    # the stops first: a call's yield points count the rows they ended at this step as done
                    [*([stops] if stops is not None else []), *self._yield_points(batch, rest, stops)]
                ),
                do_sample=False,
                **inputs,
            )
            steps = step_logprobs(torch, out, batch.collated.width, first.top_logprobs) if first.logprobs else None
        return Generated(batch, out.sequences.tolist(), steps, streams, grammars)

    def _sampler(self, batch: LocalBatch) -> RowSampler | None:
        """A sampled call's draws, one stream per row: its request's seed (a random one for a request without),
        which of its `n` answers the row is, and the place of each token in the answer (past any it has); None for
        a greedy call."""
        first = batch.params[0]
        if first.greedy:
            return None
        rows = [
            RowDraws(r.params.seed if r.params.seed is not None else secrets.randbits(63), answer, len(r.generated))
            for r in batch.requests
            for answer in range(first.n)
        ]
        top_k = getattr(self._model.generation_config, "top_k", None)
        return RowSampler(first.temperature, first.top_p, top_k, rows, batch.collated.width)

    def _yield_points(self, batch: LocalBatch, rest: list[int], stops: StopSequences | None) -> list[YieldPoints]:
        """Where the call may stop between decoding steps (none: it runs to its end)."""
        first = batch.params[0]
        lines = any(r.background for r in batch.requests)
        if self._waiting is None or not self.yield_tokens or first.n > 1 or first.logprobs or lines:
            return []
        width, ends = batch.collated.width, self._stop_ids()
        finished = stops.done if stops is not None else set()
        return [YieldPoints(self.yield_tokens, width, rest, ends, self._waiting, self._max_rows, finished)]

    def _stop_sequences(self, batch: LocalBatch) -> StopSequences | None:
        """The rows' stop sequences (each request's, for each of its `n` rows), with the answer each row has so
        far; None when no request has any."""
        n = batch.params[0].n
        if not any(r.params.stop for r in batch.requests):
            return None
        stops = [tuple(r.params.stop) for r in batch.requests for _ in range(n)]
        prefixes = [list(r.generated) for r in batch.requests for _ in range(n)]
        return StopSequences(stops, prefixes, batch.collated.width, self._decode, self._stop_ids())

    def _grammars(self, batch: LocalBatch) -> GrammarMask | None:
        """The rows' grammars (each request's, for each of its `n` rows), past any answer so far; None when no row
        has one."""
        n = batch.params[0].n
        grammars = [grammar for grammar in map(grammar_for, batch.params) for _ in range(n)]
        if not any(g is not None for g in grammars):
            return None
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = token_grammar(self._tokenizer)
        done = [list(r.generated) for r in batch.requests for _ in range(n)]
        end = int(self._tokenizer.eos_token_id)
        return GrammarMask(self._grammar_tokenizer, grammars, batch.collated.width, done, end=end)

    def _streams(self, batch: LocalBatch) -> RowStreams | None:
        """The rows streamed to their jobs: a streamed request's (one answer each: a stream has no `n`)."""
        if self.pieces is None:
            return None
        n = batch.params[0].n
        rows = [
            StreamedRow(
                i * n, r.stream_to, self._limit(r), TextStream(r.params.stop, sent=r.sent), prefix=list(r.generated)
            )
            for i, r in enumerate(batch.requests)
            if r.stream_to is not None
        ]
        if not rows:
            return None
        return RowStreams(rows, batch.collated.width, self._decode, self._stop_ids(), self.pieces)

    def _decode(self, ids: list[int]) -> str:
        """An answer's token ids as its text (special tokens left out)."""
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def _limit(self, request: ModelRequest) -> int:
        """The most new tokens the request's answer may have: as it asks, within the cap and the context's room."""
        prompt_tokens = len(request.prompt_ids)
        room = self.max_context_tokens - prompt_tokens if self.max_context_tokens else None
        return request.params.new_tokens(self.max_new_tokens, self.max_tokens_cap, room)

    def unbatch(self, output: Generated | EngineRun) -> list[Outcome]:
        """Decode each row's answer (the tokens it had, then this call's), cut to its own limit and stop
        sequences; a request's `n` rows become its answer and the `more` after it. A streamed row's last piece is
        sent. An answer the call stopped before its end comes back `Continued`; a request a row of which broke its
        grammar fails alone (`inference_failed`). A call on the engine: `_engine_outcomes`."""
        if isinstance(output, EngineRun):
            return self._engine_outcomes(output)
        return self._generated_outcomes(output)

    def _generated_outcomes(self, output: Generated) -> list[Outcome]:
        batch, rows, steps = output.batch, output.rows, output.steps
        width = batch.collated.width
        ran = len(rows[0]) - width if rows else 0
        generated = strip_generated(rows, width, self._stop_ids())
        n = batch.params[0].n
        outcomes: list[Outcome] = []
        for i, request in enumerate(batch.requests):
            broken = output.broken(range(i * n, (i + 1) * n))
            if broken is not None:
                outcomes.append(broken)
                continue
            answers = [
                self._answer(request, generated[row], ran, steps[row] if steps else None)
                for row in range(i * n, (i + 1) * n)
            ]
            first = answers[0]
            if isinstance(first, Continued):  # a call that yields has one row per request
                sent = output.streams.sent(i * n) if output.streams is not None else ""
                outcomes.append(replace(first, sent=sent))
                continue
            done = [a for a in answers if isinstance(a, Prediction)]
            tokens = sum(a.completion_tokens for a in done)
            outcomes.append(replace(done[0], completion_tokens=tokens, more=tuple(done[1:])))
            if output.streams is not None:
                output.streams.finish(i * n, done[0].text)
        return outcomes

    def _engine_outcomes(self, run: EngineRun) -> list[Outcome]:
        """Each request's outcome from the engine: its answers, its failure, or (parked) its answer so far."""
        outcomes: list[Outcome] = []
        for i, request in enumerate(run.batch.requests):
            done = run.finished.get(i)
            if done is not None:
                outcomes.append(self._finished(request, done.rows))
                continue
            rows = run.going.get(i, [])
            stream = rows[0].stream if rows else None
            generated = tuple(rows[0].tokens) if rows else request.generated
            outcomes.append(Continued(generated, stream.sent if stream is not None else request.sent))
        return outcomes

    def _finished(self, request: ModelRequest, rows: list[Row]) -> Outcome:
        """A request whose rows all ended: its answers (the first, and `more`), or its failure."""
        failure = next((row.failure for row in rows if row.failure is not None), None)
        if failure is not None or not rows or rows[0].end == "cancelled":
            why = f"the answer could not be held to its format ({failure}): it was ended" if failure else "dropped"
            return InferenceFailed(why, stage="infer")
        answers = [self._row_answer(request, row) for row in rows]
        first = answers[0]
        stream = rows[0].stream
        if stream is not None and self.pieces is not None and request.stream_to is not None:
            send_piece(self.pieces, request.stream_to, stream.finish(first.text))
        tokens = sum(a.completion_tokens for a in answers)
        return replace(first, completion_tokens=tokens, more=tuple(answers[1:]))

    def _row_answer(self, request: ModelRequest, row: Row) -> Prediction:
        """One engine row's answer, cut to its limit and stop sequences."""
        params = request.params
        kept = row.tokens[: self._limit(request)]
        text, _ = apply_stop(self._decode(kept), params.stop)
        answer = Prediction(
            text=text,
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=len(kept),
            finish_reason="length" if row.end == "length" else "stop",
            logprobs=[self._entry(step) for step in row.steps[: len(kept)]] if params.logprobs else None,
        )
        return with_calls(answer, params)

    def _stop_ids(self) -> set[int]:
        """The ids a row ends at: padding and end of sequence."""
        return {self.pad_id, int(self._tokenizer.eos_token_id)}

    def _answer(
        self, request: ModelRequest, new: list[int], ran: int, steps: list[Step] | None = None
    ) -> Prediction | Continued:
        """One row's answer: the tokens it had and the `new` ones of this call, which ran `ran` steps (fewer new
        tokens: the row reached its end of sequence)."""
        params = request.params
        limit = self._limit(request)
        kept = [*request.generated, *new][:limit]
        text, stopped = apply_stop(self._decode(kept), params.stop)
        if not (stopped or len(new) < ran or len(kept) >= limit):
            return Continued(tuple(kept))
        ended = stopped or len(kept) < limit  # an end-of-sequence token (or a stop sequence) came first
        answer = Prediction(
            text=text,
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=len(kept),
            finish_reason="stop" if ended else "length",
            logprobs=[self._entry(step) for step in steps[: len(kept)]] if steps is not None else None,
        )
        return with_calls(answer, params)

    def _entry(self, step: Step) -> dict[str, Any]:
        """One answer token's log probability and its likeliest alternatives, in OpenAI's shape."""
        (chosen, logprob), top = step
        return {**self._token(chosen, logprob), "top_logprobs": [self._token(t, lp) for t, lp in top]}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
