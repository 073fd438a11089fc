"""The local model's decode loop: every row keeps its KV cache across steps, so a prompt is read once.

A request joins the running batch at the next step: the prompts that join together are read together, left-padded
to one width (a picture's embeddings in place of its image tokens), then their caches merged into the batch's. While
rows run, a joining prompt is read at most `prefill_chunk` tokens a step (chunked prefill), so the running rows go on
getting a token every step instead of waiting for a long prompt (a picture's) to be read whole. A row that ends or
is cancelled leaves at once (its cache dropped), and every step feeds each running row one token: its last. A
request that is set aside between calls (`park`) keeps its cache, and picks it up again when the same prompt and
answer so far come back (`submit`), so a call that stops for waiting requests costs no re-read.

By hand rather than on transformers' continuous batching manager (`init_continuous_batching`, 5.25): that one
draws every request from one generator (one seed for the manager, `do_sample` for all), runs one list of logits
processors over all requests (only their parameters vary per request: no llguidance matcher of a row's own), hands
back the chosen token's log probability alone (no `top_logprobs`), and builds its inputs from token ids alone (no
vision-language model's image embeddings); so it carries neither a seeded answer that is the same beside any
traffic, nor grammars, nor top_logprobs, nor pictures. Here each row is sampled by a draw of its own (`RowDraws`),
masked by its own grammar (`RowGrammar`), and a picture's embeddings go in once, with its prompt.

transformers' internals, fenced here: the batch's cache is one `DynamicCache` (5.x: `layers[i].keys`/`.values`, each
batch × heads × tokens × head width) whose rows this module adds (left-padded to a common length, the attention mask
saying what is padding) and removes between steps, its layers `growing_layer()`s that write each step's keys and
values into room kept at their end (a `DynamicLayer` concatenates: it copies the whole cache at every step); models
whose layers are all full attention (Llama: SmolLM2, Idefics3's text model), given `logits_to_keep` and, for
pictures, `mm_encoder_outputs`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from stoker.adapters.backends.engine_cache import (
    ROOM_LEAST,
    ROOM_MOST,
    growing_layer,
    pad_mask,
    read_groups,
)
from stoker.adapters.backends.engine_rows import (
    EngineFull,
    EngineRequest,
    Finished,
    Row,
    RowDraws,
    reach,
    step_logprobs,
)
from stoker.adapters.backends.grammar import RowGrammar
from stoker.adapters.backends.streams import Pieces, send_piece
from stoker.core.model import apply_stop
from stoker.core.streaming import TextStream

log = logging.getLogger(__name__)


@dataclass
class _Parked:
    rows: list[Row]
    #: Their cache, once taken out of the batch (None: still in it).
    kv: list[tuple[Any, Any]] | None


@dataclass
class _Filling:
    """Requests whose prompts (with any answers so far) are read together: left-padded to one width, a chunk of
    columns at a time, into a cache of their own that joins the batch's once the last column is read."""

    requests: list[EngineRequest]
    #: Their tokens and attention mask (requests × width, padding 0), each one's length.
    ids: Any
    mask: Any
    lengths: list[int]
    #: Per request, its pictures' embeddings in placeholder order as one tensor (None: no picture), and per column
    #: how many image tokens it has up to there (None when no request has a picture).
    pictures: list[Any]
    images: Any
    cache: Any
    #: Columns read so far.
    read: int = 0

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])


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
        prefill_chunk: int = 0,
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
        #: Prompt tokens read at most in a step while rows run (0: joining prompts are read whole at once).
        self.prefill_chunk = prefill_chunk
        #: A vision-language model's image placeholder (its embeddings go in its place).
        self.image_token = getattr(getattr(model, "config", None), "image_token_id", None)
        self.grammar_tokenizer = grammar_tokenizer
        self.pieces = pieces
        self.top_k = getattr(getattr(model, "generation_config", None), "top_k", None)
        #: Tokens the model was fed (prompts at prefill, one per row per step).
        self.fed = 0
        self._rows: list[Row] = []
        self._queued: list[EngineRequest] = []
        #: Prompts being read (chunked prefill), in the order they came.
        self._filling: list[_Filling] = []
        #: Requests cancelled while their prompts were being read.
        self._cancelled: set[Hashable] = set()
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
        return self.max_rows - self.rows - sum(r.params.n for r in self._waiting)

    @property
    def rows(self) -> int:
        """Rows running now (rows set aside are not)."""
        return sum(not row.parked for row in self._rows)

    @property
    def busy(self) -> bool:
        """Whether any request runs or waits to join."""
        return bool(self.rows or self._waiting)

    @property
    def reading(self) -> bool:
        """Whether prompts are being read (`prefill_chunk`): a call that stopped now would have them read again."""
        return bool(self._filling)

    @property
    def _waiting(self) -> list[EngineRequest]:
        """Requests not running yet: queued, or their prompts being read."""
        return [*self._queued, *(r for filling in self._filling for r in filling.requests)]

    @property
    def reserved(self) -> int:
        """Cache tokens the running and queued rows may reach (each its prompt and its limit)."""
        running = sum(reach(row.request) for row in self._rows)
        return running + sum(reach(r) * r.params.n for r in self._waiting)

    def submit(self, request: EngineRequest) -> None:
        """Queue a request: it joins at the next step (raises `EngineFull` past the room, in rows or in cache
        tokens, while any other runs or waits: one larger than the whole room runs alone)."""
        if request.params.n > self.room and self.busy:
            raise EngineFull(f"{request.params.n} rows asked, {self.room} free")
        tokens = reach(request) * request.params.n
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
        if any(r.key == key for r in self._waiting):
            self._cancelled.add(key)  # its prompt is being read: it leaves at the next step

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
        """One decoding step: the dropped rows leave, every running row gets one token, the queued prompts are read
        (a chunk of them while rows run: `prefill_chunk`), those read to their end join (their first token from
        their prompt's read); the requests whose answers all ended."""
        import torch  # heavy: in the model's process only

        with torch.inference_mode():
            self._expire(torch)
            self._leave(torch)
            # a parked request rejoins before the step (its next token is this step's), a new one after it (its
            # first token is its prompt's read)
            resumed = [r for r in self._queued if r.content in self._parked]
            for request in resumed:
                self._queued.remove(request)
                self._resume(request, torch)
            self._stow(torch)
            running = bool(self._rows)
            if running:
                self._decode(torch)
            self._fill(torch, self.prefill_chunk if running else 0)
            self._leave(torch)
        finished, self._finished = self._finished, []
        return finished

    # -- joining ---------------------------------------------------------------------------------------------------
    def _resume(self, request: EngineRequest, torch: Any) -> None:
        """A parked request back: its rows go on from their cache (back into the batch if it was taken out)."""
        parked = self._unpark(request.content)
        assert parked is not None
        for row in parked.rows:
            row.request, row.parked = request, False  # its key and deadline as it came back
        if parked.kv is not None:  # stowed: back into the batch (else it never left)
            going = [i for i, row in enumerate(parked.rows) if row.end is None]
            if going:
                kv = [(k[going], v[going]) for k, v in parked.kv]
                length = int(kv[0][0].shape[2])
                mask = torch.ones((len(going), length), dtype=torch.long, device=self.device)
                self._add([parked.rows[i] for i in going], kv, mask, torch)
            self._settle(parked.rows)

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

    def _fill(self, torch: Any, budget: int) -> None:
        """Read the waiting prompts: the queued ones start (in groups alike in length), then the groups are read in
        the order they came, `budget` tokens in all this step (0: every one to its end); a group read to its end
        joins the batch."""
        if self._queued:
            self._filling.extend(self._start(group, torch) for group in read_groups(self._queued))
            self._queued = []
        left = budget
        while self._filling and (not budget or left > 0):
            filling = self._filling[0]
            requests = len(filling.requests)
            unread = filling.width - filling.read
            columns = min(unread, max(1, left // requests)) if budget else unread
            logits = self._read(filling, columns, torch)
            left -= columns * requests
            if logits is None:
                return
            self._filling.pop(0)
            self._joined(filling, logits, torch)

    def _start(self, requests: list[EngineRequest], torch: Any) -> _Filling:
        """Requests whose prompts are read together: their tokens left-padded to the longest."""
        from transformers import DynamicCache

        prompts = [[*r.prompt_ids, *r.generated] for r in requests]
        width = max(len(ids) for ids in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt, device=self.device)
            mask[i, width - len(prompt) :] = 1
        pictures = [torch.cat(list(r.features)) if r.features else None for r in requests]
        images = None
        if any(p is not None for p in pictures) and self.image_token is not None:
            images = (ids == self.image_token).cumsum(1)
        return _Filling(list(requests), ids, mask, [len(p) for p in prompts], pictures, images, DynamicCache())

    def _read(self, filling: _Filling, columns: int, torch: Any) -> Any:
        """Read the next `columns` columns of a group's prompts; after its last, the logits after each one."""
        start, end = filling.read, filling.read + columns
        mask = filling.mask[:, :end]
        positions = (mask.cumsum(1) - 1).clamp(min=0)[:, start:]
        inputs: dict[str, Any] = {}
        pictures = self._pictures_between(filling, start, end)
        if pictures:
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            inputs["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=pictures)}
        out = self.model(
            input_ids=filling.ids[:, start:end],
            attention_mask=mask,
            position_ids=positions,
            cache=filling.cache,
            use_cache=True,
            logits_to_keep=1,
            **inputs,
        )
        self.fed += int(filling.mask[:, start:end].sum())
        filling.read = end
        return out.logits[:, -1] if end == filling.width else None

    @staticmethod
    def _pictures_between(filling: _Filling, start: int, end: int) -> list[Any]:
        """The embeddings of the image tokens in columns [start, end), request after request."""
        if filling.images is None:
            return []
        found = []
        for i, picture in enumerate(filling.pictures):
            before = int(filling.images[i, start - 1]) if start else 0
            upto = int(filling.images[i, end - 1])
            if picture is not None and upto > before:
                found.append(picture[before:upto])
        return found

    def _joined(self, filling: _Filling, logits: Any, torch: Any) -> None:
        """A group read to its end: each request's rows choose their first token and join the batch."""
        rows: list[Row] = []
        going: list[int] = []
        for i, request in enumerate(filling.requests):
            for answer in range(request.params.n):
                row = self._row(request, answer)
                row.cached = filling.lengths[i]
                self._choose(row, logits[i], torch)
                rows.append(row)
                if row.end is None:
                    going.append(len(rows) - 1)
        if going:
            index = torch.tensor(
                [i for i, request in enumerate(filling.requests) for _ in range(request.params.n)], device=self.device
            )[going]
            kv = [(layer.keys[index], layer.values[index]) for layer in filling.cache.layers]
            self._add([rows[i] for i in going], kv, filling.mask[index], torch)
        self._settle(rows)

    def _add(self, rows: list[Row], kv: list[tuple[Any, Any]], mask: Any, torch: Any) -> None:
        """Add rows to the batch (their caches and masks, a row each), all left-padded to a common length."""
        common = max(int(self._mask.shape[1]) if self._cache is not None else 0, int(mask.shape[1]))
        mask = pad_mask(mask, common)
        parts = [[(keys, values)] for keys, values in kv]
        if self._cache is not None:
            parts = [[(layer.keys, layer.values), *part] for layer, part in zip(self._cache.layers, parts, strict=True)]
            mask = torch.cat([pad_mask(self._mask, common), mask])
        self._rows.extend(rows)
        self._hold(parts, mask)

    def _hold(self, layers: list[list[tuple[Any, Any]]], mask: Any) -> None:
        """Make these the batch's cache (per layer, its rows' caches in order) and mask, with room at the end for
        the steps its rows may still take."""
        from transformers import DynamicCache

        most = max((row.request.limit - len(row.tokens) for row in self._rows), default=0)
        room = min(max(most, ROOM_LEAST), ROOM_MOST)
        self._cache = DynamicCache()
        layer = growing_layer()
        self._cache.layers = [layer(parts, room) for parts in layers]
        self._mask = mask

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
            row.steps.append(step_logprobs(raw, token, row.request.params.top_logprobs, torch))
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
    def _expire(self, torch: Any) -> None:
        now = time.time()
        for row in self._rows:
            deadline = row.request.deadline
            if row.end is None and not row.parked and deadline is not None and deadline <= now:
                row.end = "cancelled"
        for request in [r for r in self._queued if r.deadline is not None and r.deadline <= now]:
            self._queued.remove(request)
            self._finished.append(Finished(request.key, []))
        cancelled, self._cancelled = self._cancelled, set()
        self._drop_filling(lambda r: r.key in cancelled or (r.deadline is not None and r.deadline <= now), torch)

    def _drop_filling(self, dropped: Callable[[EngineRequest], bool], torch: Any) -> None:
        """Drop the requests whose prompts are being read that `dropped` says (each `Finished` unanswered)."""
        for filling in list(self._filling):
            kept = [i for i, request in enumerate(filling.requests) if not dropped(request)]
            if len(kept) == len(filling.requests):
                continue
            for request in filling.requests:
                if dropped(request):
                    self._finished.append(Finished(request.key, []))
            if not kept:
                self._filling.remove(filling)
                continue
            index = torch.tensor(kept, device=self.device)
            filling.requests = [filling.requests[i] for i in kept]
            filling.lengths = [filling.lengths[i] for i in kept]
            filling.pictures = [filling.pictures[i] for i in kept]
            filling.ids, filling.mask = filling.ids[index], filling.mask[index]
            filling.images = filling.images[index] if filling.images is not None else None
            for layer in filling.cache.layers:
                layer.keys, layer.values = layer.keys[index], layer.values[index]

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
        mask = self._mask[index]
        start = int(mask.any(0).nonzero()[0])
        kept = [[(layer.keys[index, :, start:], layer.values[index, :, start:])] for layer in self._cache.layers]
        self._hold(kept, mask[:, start:])

    def _layers(self) -> list[tuple[Any, Any]]:
        return [(layer.keys, layer.values) for layer in self._cache.layers]
