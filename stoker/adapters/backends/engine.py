"""The local model's decode loop: every row keeps its KV cache across steps, so a prompt is read once.

A request joins the running batch at the next step (its prompt read once, alone, then its cache merged into the
batch's), a row that ends or is cancelled leaves at once (its cache dropped), and every step feeds each running row
one token: its last. A request that is set aside between calls (`park`) keeps its cache, and picks it up again when
the same prompt and answer so far come back (`submit`), so a call that stops for waiting requests costs no re-read.

By hand rather than on transformers' continuous batching manager (`init_continuous_batching`, 5.25): that one
draws every request from one generator (one seed for the manager, `do_sample` for all), runs one list of logits
processors over all requests (only their parameters vary per request: no llguidance matcher of a row's own), hands
back the chosen token's log probability alone (no `top_logprobs`), and builds its inputs from token ids alone (no
vision-language model's image embeddings); so it carries neither a seeded answer that is the same beside any
traffic, nor grammars, nor top_logprobs, nor pictures. Here each row is sampled by a draw of its own (`RowDraws`),
masked by its own grammar (`RowGrammar`), and a picture's embeddings go in once, with its prompt.

transformers' internals, fenced here: the batch's cache is one `DynamicCache` (5.x: `layers[i].keys`/`.values`, each
batch × heads × tokens × head width) whose rows this module adds (left-padded to a common length, the attention mask
saying what is padding) and removes between steps; models whose layers are all full attention (Llama: SmolLM2,
Idefics3's text model).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stoker.adapters.backends.grammar import RowGrammar
from stoker.adapters.backends.streams import Pieces, send_piece
from stoker.core.model import GenerationParams, apply_stop
from stoker.core.streaming import TextStream

log = logging.getLogger(__name__)

#: One generated token's (id, log probability), and the likeliest tokens' at its place.
Step = tuple[tuple[int, float], list[tuple[int, float]]]


class EngineFull(Exception):
    """The engine has no room for the request's rows."""


@dataclass(frozen=True)
class EngineRequest:
    """One request as the engine takes it: its prompt, how it is sampled, how many new tokens its answers may have
    (`limit`: in all, the answer so far counted), and what goes with it."""

    key: Hashable
    prompt_ids: Sequence[int]
    params: GenerationParams = field(default_factory=GenerationParams)
    limit: int = 64
    #: An answer under way: the tokens it has (its parked cache is picked up when it holds them).
    generated: tuple[int, ...] = ()
    #: The llguidance grammar its answers must follow (None: free text).
    grammar: str | None = None
    #: The job its (first) answer is streamed to, and what of it was sent already.
    stream_to: str | None = None
    sent: str = ""
    #: A vision-language model's: its pictures' embeddings in placeholder order, and their content hashes.
    features: Sequence[Any] = ()
    images: tuple[str, ...] = ()
    #: When (time.time()) it is dropped at the next step, unanswered.
    deadline: float | None = None

    @property
    def content(self) -> tuple[Any, ...]:
        """What its cache holds: the same prompt, pictures and answer so far make the same cache."""
        return (tuple(self.prompt_ids), self.images, self.generated)


@dataclass
class Row:
    """One answer being generated: its tokens, its log probabilities, how it ended (None: it goes on)."""

    request: EngineRequest
    answer: int
    draws: RowDraws | None
    grammar: RowGrammar | None
    stream: TextStream | None
    tokens: list[int]
    steps: list[Step] = field(default_factory=list)
    end: str | None = None
    #: Why its grammar failed (its request fails).
    failure: str | None = None
    #: Prompt and answer tokens in its cache (its next position).
    cached: int = 0
    #: Set aside between calls (`DecodeEngine.park`).
    parked: bool = False
    #: The end-of-sequence token it ended at (never one of its `tokens`), if it did.
    end_token: int | None = None


@dataclass(frozen=True)
class Finished:
    """A request whose answers all ended (`stop`, `length`, or `cancelled`: dropped unanswered)."""

    key: Hashable
    rows: list[Row]


@dataclass(frozen=True)
class RowDraws:
    """Where a sampled row's draws come from: its request's seed, which of its answers it is. The draw for the
    answer's k-th token is fixed by these and k alone, never by the rows beside it."""

    seed: int
    answer: int

    def uniform(self, place: int) -> float:
        """A number in [0, 1) for the answer's token at `place`."""
        import hashlib

        digest = hashlib.blake2b(f"{self.seed}:{self.answer}:{place}".encode(), digest_size=8).digest()
        return (int.from_bytes(digest, "little") >> 11) * 2.0**-53  # the top 53 bits: every double in [0, 1)


@dataclass
class _Parked:
    rows: list[Row]
    #: Their cache, once taken out of the batch (None: still in it).
    kv: list[tuple[Any, Any]] | None


class DecodeEngine:
    """A running batch of rows over one model (see the module): `submit` requests, `step` until they are
    `Finished`, `cancel` or `park` them between steps. `fed` counts the tokens the model was given."""

    def __init__(
        self,
        model: Any,
        decode: Callable[[list[int]], str],
        stop_ids: set[int],
        *,
        max_rows: int,
        device: str = "cpu",
        grammar_tokenizer: Callable[[], Any] | None = None,
        pieces: Pieces | None = None,
        parked_rows: int | None = None,
        end: int | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.model = model
        self.decode = decode
        self.stop_ids = stop_ids
        #: The token a row whose grammar failed is ended with (the end of sequence).
        self.end_id = min(stop_ids) if end is None else end
        self.max_rows = max_rows
        #: The KV cache's size in tokens: what running and queued rows may reach (prompt and limit) in all.
        self.max_tokens = max_tokens
        self.device = device
        self.grammar_tokenizer = grammar_tokenizer
        self.pieces = pieces
        self.top_k = getattr(getattr(model, "generation_config", None), "top_k", None)
        #: Tokens the model was fed (prompts at prefill, one per row per step).
        self.fed = 0
        self._rows: list[Row] = []
        self._queued: list[EngineRequest] = []
        self._finished: list[Finished] = []
        self._ended: dict[Hashable, list[Row]] = {}
        self._cache: Any = None
        self._mask: Any = None
        #: Parked requests by what their caches hold (requests alike in prompt and answer so far share a key).
        self._parked: OrderedDict[tuple[Any, ...], list[_Parked]] = OrderedDict()
        #: Parked rows kept at most (None: as many as the engine's room).
        self.parked_rows = parked_rows

    # -- what the caller sees ------------------------------------------------------------------------------------
    @property
    def room(self) -> int:
        """Rows that can still join (running and queued rows count)."""
        return self.max_rows - self.rows - sum(r.params.n for r in self._queued)

    @property
    def rows(self) -> int:
        """Rows running now (rows set aside are not)."""
        return sum(not row.parked for row in self._rows)

    @property
    def busy(self) -> bool:
        """Whether any request runs or waits to join."""
        return bool(self.rows or self._queued)

    @property
    def reserved(self) -> int:
        """Cache tokens the running and queued rows may reach (each its prompt and its limit)."""
        running = sum(_reach(row.request) for row in self._rows)
        return running + sum(_reach(r) * r.params.n for r in self._queued)

    def submit(self, request: EngineRequest) -> None:
        """Queue a request: it joins at the next step (raises `EngineFull` past the room, in rows or in cache
        tokens, while any other runs or waits: one larger than the whole room runs alone)."""
        if request.params.n > self.room and self.busy:
            raise EngineFull(f"{request.params.n} rows asked, {self.room} free")
        tokens = _reach(request) * request.params.n
        if self.max_tokens is not None and self.busy and self.reserved + tokens > self.max_tokens:
            raise EngineFull(f"{tokens} cache tokens asked, {self.max_tokens - self.reserved} free")
        self._queued.append(request)

    def cancel(self, key: Hashable) -> None:
        """Drop a request's rows at the next step (it comes back `Finished`, `cancelled`)."""
        for row in self._rows:
            if row.request.key == key and row.end is None:
                row.end = "cancelled"
        for request in [r for r in self._queued if r.key == key]:
            self._queued.remove(request)
            self._finished.append(Finished(key, []))

    def park(self, key: Hashable) -> list[Row]:
        """Set a running request's rows aside, keeping their cache for when it comes back. They stay in the batch
        until the next step: a request that comes back by then goes on in place (nothing copied); the others'
        caches are taken out of the batch then (`_stow`), the oldest let go past the room."""
        rows = [row for row in self._rows if row.request.key == key and not row.parked]
        if not rows:
            return []
        for row in rows:
            row.parked = True
        first = rows[0].request
        self._parked.setdefault((*first.content[:2], tuple(rows[0].tokens)), []).append(_Parked(rows, None))
        return rows

    def _stow(self, torch: Any) -> None:
        """Take the rows still set aside out of the batch, each request's cache on its own; let the oldest go
        past the room."""
        indices = [i for i, row in enumerate(self._rows) if row.parked]
        if not indices:
            return
        width = int(self._mask.shape[1])
        for alike in self._parked.values():
            for parked in alike:
                if parked.kv is None:
                    at = [self._rows.index(row) for row in parked.rows]
                    cut = width - parked.rows[0].cached
                    parked.kv = [(k[at][:, :, cut:], v[at][:, :, cut:]) for k, v in self._layers()]
        self._keep([i for i, row in enumerate(self._rows) if not row.parked], torch)
        most = self.max_rows if self.parked_rows is None else self.parked_rows
        while sum(len(p.rows) for alike in self._parked.values() for p in alike) > most:
            oldest = next(iter(self._parked))
            self._parked[oldest].pop(0)
            if not self._parked[oldest]:
                del self._parked[oldest]

    def step(self) -> list[Finished]:
        """One decoding step: the dropped rows leave, every running row gets one token, the queued requests join
        (their first token from their prompt's read); the requests whose answers all ended."""
        import torch  # heavy: in the model's process only

        with torch.inference_mode():
            self._expire()
            self._leave(torch)
            # a parked request rejoins before the step (its next token is this step's), a new one after it (its
            # first token is its prompt's read)
            resumed = [r for r in self._queued if r.content in self._parked]
            for request in resumed:
                self._queued.remove(request)
                self._join(request, torch)
            self._stow(torch)
            if self._rows:
                self._decode(torch)
            while self._queued:
                self._join(self._queued.pop(0), torch)
            self._leave(torch)
        finished, self._finished = self._finished, []
        return finished

    # -- joining ---------------------------------------------------------------------------------------------------
    def _join(self, request: EngineRequest, torch: Any) -> None:
        parked = self._unpark(request.content)
        if parked is not None:
            for row in parked.rows:
                row.request, row.parked = request, False  # its key and deadline as it came back
            if parked.kv is not None:  # stowed: back into the batch (else it never left)
                self._merge(parked.rows, parked.kv, torch)
            return
        ids = [*request.prompt_ids, *request.generated]
        cache, logits = self._prefill(ids, request.features, torch)
        rows = [self._row(request, answer) for answer in range(request.params.n)]
        for row in rows:
            row.cached = len(ids)
            self._choose(row, logits, torch)
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        self._merge(rows, kv, torch)

    def _unpark(self, content: tuple[Any, ...]) -> _Parked | None:
        alike = self._parked.get(content)
        if not alike:
            return None
        parked = alike.pop(0)
        if not alike:
            del self._parked[content]
        return parked

    def _row(self, request: EngineRequest, answer: int) -> Row:
        params = request.params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        draws = None if params.greedy else RowDraws(seed, answer)
        grammar = None
        if request.grammar is not None and self.grammar_tokenizer is not None:
            grammar = RowGrammar(self.grammar_tokenizer(), request.grammar, request.generated, end=self.end_id)
        streamed = request.stream_to is not None and answer == 0 and self.pieces is not None
        stream = TextStream(params.stop, sent=request.sent) if streamed else None
        return Row(request, answer, draws, grammar, stream, list(request.generated))

    def _prefill(self, ids: list[int], features: Sequence[Any], torch: Any) -> tuple[Any, Any]:
        """Read a prompt (and any answer so far) alone into a cache of its own; the logits after its last token."""
        from transformers import DynamicCache

        cache = DynamicCache()
        inputs: dict[str, Any] = {}
        if features:
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            inputs["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=list(features))}
        tokens = torch.tensor([ids], device=self.device)
        out = self.model(
            input_ids=tokens, attention_mask=torch.ones_like(tokens), cache=cache, use_cache=True, **inputs
        )
        self.fed += len(ids)
        return cache, out.logits[0, -1]

    def _merge(self, rows: list[Row], kv: list[tuple[Any, Any]], torch: Any) -> None:
        """Add rows (one cache, repeated for each row) to the batch, left-padded to a common length."""
        going = [i for i, row in enumerate(rows) if row.end is None]
        if going:
            self._add(rows, going, kv, torch)
        self._settle(rows)

    def _add(self, rows: list[Row], going: list[int], kv: list[tuple[Any, Any]], torch: Any) -> None:
        count, length = len(going), int(kv[0][0].shape[2])
        if int(kv[0][0].shape[0]) == 1:  # one prompt's read, for each of its rows
            kv = [(k.expand(count, -1, -1, -1), v.expand(count, -1, -1, -1)) for k, v in kv]
        else:
            kv = [(k[going], v[going]) for k, v in kv]
        width = int(self._mask.shape[1]) if self._cache is not None else 0
        common = max(width, length)
        mask = torch.zeros((count, common), dtype=torch.long, device=self.device)
        mask[:, common - length :] = 1
        new = [(_pad(k, common), _pad(v, common)) for k, v in kv]
        if self._cache is None:
            from transformers import DynamicCache

            self._cache = DynamicCache(ddp_cache_data=[(k.contiguous(), v.contiguous()) for k, v in new])
            self._mask = mask
        else:
            for layer, (k, v) in zip(self._cache.layers, new, strict=True):
                layer.keys = torch.cat([_pad(layer.keys, common), k])
                layer.values = torch.cat([_pad(layer.values, common), v])
            old = torch.zeros((self._mask.shape[0], common - width), dtype=torch.long, device=self.device)
            self._mask = torch.cat([torch.cat([old, self._mask], 1), mask])
        self._rows.extend(rows[i] for i in going)

    # -- decoding --------------------------------------------------------------------------------------------------
    def _decode(self, torch: Any) -> None:
        """Feed each running row its last token; choose its next one."""
        last = torch.tensor([[row.tokens[-1]] for row in self._rows], device=self.device)
        positions = torch.tensor([[row.cached] for row in self._rows], device=self.device)
        ones = torch.ones((len(self._rows), 1), dtype=torch.long, device=self.device)
        self._mask = torch.cat([self._mask, ones], 1)
        out = self.model(
            input_ids=last,
            attention_mask=self._mask,
            position_ids=positions,
            cache=self._cache,
            use_cache=True,
        )
        self.fed += len(self._rows)
        logits = out.logits[:, -1]
        for i, row in enumerate(self._rows):
            row.cached += 1
            self._choose(row, logits[i], torch)

    def _choose(self, row: Row, logits: Any, torch: Any) -> None:
        """A row's next token (its grammar's mask, then greedy or its own draw), and whether it ends there."""
        raw = logits.float()
        scores = row.grammar.mask(raw.clone(), torch) if row.grammar is not None else raw
        token = int(scores.argmax()) if row.draws is None else self._draw(row, scores, torch)
        if row.request.params.logprobs:
            row.steps.append(_step(raw, token, row.request.params.top_logprobs, torch))
        if row.grammar is not None and row.grammar.failure is not None:
            row.failure = row.grammar.failure
        if token in self.stop_ids:
            row.end, row.end_token = "stop", token
            return
        row.tokens.append(token)
        if row.grammar is not None:
            row.grammar.consume(token)
        self._check_end(row)

    def _check_end(self, row: Row) -> None:
        request = row.request
        text = self.decode(row.tokens) if request.params.stop or row.stream is not None else ""
        if request.params.stop and apply_stop(text, request.params.stop)[1]:
            row.end = "stop"
        elif len(row.tokens) >= request.limit:
            row.end = "length"
        if row.stream is not None and row.end is None and self.pieces is not None:
            piece = row.stream.advance(text)
            if piece and request.stream_to is not None:
                send_piece(self.pieces, request.stream_to, piece)

    def _draw(self, row: Row, scores: Any, torch: Any) -> int:
        """The token where the row's own draw falls in its warped distribution (temperature, the model's top_k,
        top_p, as transformers warps them)."""
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        params = row.request.params
        warped = TemperatureLogitsWarper(params.temperature)(None, scores[None])
        if self.top_k:
            warped = TopKLogitsWarper(self.top_k)(None, warped)
        if params.top_p < 1:
            warped = TopPLogitsWarper(params.top_p)(None, warped)
        probs = torch.softmax(warped[0].double(), dim=-1)
        cumulative = probs.cumsum(-1)
        assert row.draws is not None
        draw = row.draws.uniform(len(row.tokens)) * float(cumulative[-1])
        chosen = int(torch.searchsorted(cumulative, torch.tensor([draw], dtype=torch.float64), right=True))
        last = int((probs > 0).nonzero()[-1])  # the last token that can be drawn
        return min(chosen, last)

    # -- leaving ---------------------------------------------------------------------------------------------------
    def _expire(self) -> None:
        now = time.time()
        for row in self._rows:
            deadline = row.request.deadline
            if row.end is None and not row.parked and deadline is not None and deadline <= now:
                row.end = "cancelled"
        for request in [r for r in self._queued if r.deadline is not None and r.deadline <= now]:
            self._queued.remove(request)
            self._finished.append(Finished(request.key, []))

    def _leave(self, torch: Any) -> None:
        """Rows that ended leave the batch now; a request whose rows all ended is finished."""
        ended = [row for row in self._rows if row.end is not None]
        if ended:
            self._keep([i for i, row in enumerate(self._rows) if row.end is None], torch)
            self._settle(ended)

    def _settle(self, rows: list[Row]) -> None:
        """Note the rows that ended; a request none of whose rows runs any more is finished."""
        for row in rows:
            if row.end is not None:
                self._ended.setdefault(row.request.key, []).append(row)
        for key in dict.fromkeys(row.request.key for row in rows):
            if key in self._ended and all(row.request.key != key for row in self._rows):
                ended = sorted(self._ended.pop(key), key=lambda row: row.answer)
                self._finished.append(Finished(key, ended))

    def _keep(self, indices: list[int], torch: Any) -> None:
        """Keep only these rows in the batch; cut the columns that are padding in every row left."""
        self._rows = [self._rows[i] for i in indices]
        if not indices:
            self._cache, self._mask = None, None
            return
        index = torch.tensor(indices, device=self.device)
        self._mask = self._mask[index]
        start = int(self._mask.any(0).nonzero()[0])
        self._mask = self._mask[:, start:]
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]

    def _layers(self) -> list[tuple[Any, Any]]:
        return [(layer.keys, layer.values) for layer in self._cache.layers]


def _reach(request: EngineRequest) -> int:
    """The cache tokens one row of a request may reach: its prompt and its answer's limit."""
    return len(request.prompt_ids) + request.limit


def _pad(tensor: Any, length: int) -> Any:
    """A cache tensor (rows × heads × tokens × width) left-padded with zeros to `length` tokens."""
    import torch.nn.functional as functional  # heavy: in the model's process only

    missing = length - int(tensor.shape[2])
    return functional.pad(tensor, (0, 0, missing, 0)) if missing else tensor


def _step(raw: Any, token: int, top: int, torch: Any) -> Step:
    """A token's log probability under the model's raw logits (before temperature or top_p, as OpenAI's), with
    the `top` likeliest tokens'."""
    logprobs = torch.log_softmax(raw, dim=-1)
    best = logprobs.topk(top) if top else None
    alternatives = list(zip(best.indices.tolist(), best.values.tolist(), strict=True)) if best is not None else []
    return (token, float(logprobs[token])), alternatives
