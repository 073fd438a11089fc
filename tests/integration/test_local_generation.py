"""The local model's per-request generation: token limits and stop sequences within one call, seeded sampling."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from api.app import create_app
from stoker.adapters.backends import engine
from stoker.adapters.backends.grammar import RowGrammar
from stoker.adapters.backends.local import TransformersPredictor
from stoker.adapters.backends.modelstore import resolve_model
from stoker.adapters.backends.tokenizer import PromptTokenizer, load_tokenizer
from stoker.adapters.store.keys import answer_key
from stoker.core.errors import InferenceFailed
from stoker.core.model import Continued, GenerationParams, ModelRequest, Prediction, run_predictor
from stoker.core.prompting import build_prompt
from stoker.settings import ApiSettings, WorkerSettings
from tests.integration.conftest import ROOMY_TOKENS
from tests.serving import serve

#: The model runs in this process: these tests run beside no other that does (tests/conftest.py).
pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def model() -> tuple[TransformersPredictor, list[int]]:
    """The built-in model on the CPU, and a prompt that makes it talk at length."""
    settings = WorkerSettings()
    path = str(resolve_model(settings.model, settings.model_cache, fetch=False))
    # The suite's torch threads (tests/conftest.py), for this process: the later predictors here share its pool.
    predictor = TransformersPredictor(path, max_new_tokens=16, max_tokens_cap=24, threads=settings.torch_threads)
    predictor.setup("cpu")
    prompt = build_prompt(
        PromptTokenizer(load_tokenizer(path)), "Write a long story about a dragon and a castle.", [], 512
    )
    return predictor, prompt.ids


@pytest.fixture(scope="module")
def roomy(model: tuple[TransformersPredictor, list[int]]) -> TransformersPredictor:
    """The built-in model with room for a whole tool call or JSON answer (64 new tokens)."""
    predictor = TransformersPredictor(model[0].model_path, max_new_tokens=64, max_tokens_cap=64)
    predictor.setup("cpu")
    return predictor


def _ask(ids: list[int], **params: object) -> ModelRequest:
    return ModelRequest(ids, params=GenerationParams(**params))


def test_requests_of_one_call_get_their_own_token_limits(model: tuple[TransformersPredictor, list[int]]) -> None:
    predictor, ids = model
    short, long, default, capped = run_predictor(
        predictor, [_ask(ids, max_tokens=3), _ask(ids, max_tokens=12), _ask(ids), _ask(ids, max_tokens=500)]
    )
    assert isinstance(short, Prediction)
    assert isinstance(long, Prediction)
    assert isinstance(default, Prediction)
    assert isinstance(capped, Prediction)
    assert (short.completion_tokens, short.finish_reason) == (3, "length")
    assert (long.completion_tokens, long.finish_reason) == (12, "length")
    assert default.completion_tokens == 16  # the deployment's default
    assert capped.completion_tokens == 24  # the cap, whatever was asked
    assert long.text.startswith(short.text)  # the same greedy answer, cut at different lengths


def test_a_stop_sequence_ends_the_answer_before_it(model: tuple[TransformersPredictor, list[int]]) -> None:
    predictor, ids = model
    (whole,) = run_predictor(predictor, [_ask(ids, max_tokens=12)])
    assert isinstance(whole, Prediction)
    word = whole.text.split()[2]
    (stopped,) = run_predictor(predictor, [_ask(ids, max_tokens=12, stop=[word])])
    assert isinstance(stopped, Prediction)
    assert stopped.finish_reason == "stop"
    assert word not in stopped.text
    assert whole.text.startswith(stopped.text)


def _through(entries: list[dict[str, Any]], stop: str) -> int:
    """How many of an answer's tokens (its log probability entries) there are up to and including the one whose text
    completes the stop sequence."""
    return next(k for k in range(1, len(entries) + 1) if stop in "".join(e["token"] for e in entries[:k]))


def test_a_stop_sequence_ends_generation_at_the_token_that_completes_it(
    model: tuple[TransformersPredictor, list[int]],
) -> None:
    predictor, ids = model
    (whole,) = run_predictor(predictor, [_ask(ids, max_tokens=24, logprobs=True)])
    assert isinstance(whole, Prediction)
    assert whole.logprobs is not None
    word = whole.text.split()[2]
    through = _through(whole.logprobs, word)
    assert through < 12  # early in an answer that runs on to 24 tokens
    (stopped,) = run_predictor(predictor, [_ask(ids, max_tokens=24, logprobs=True, stop=[word])])
    assert isinstance(stopped, Prediction)
    assert (stopped.finish_reason, stopped.completion_tokens) == ("stop", through)
    assert stopped.logprobs == whole.logprobs[:through]  # they end with the token that completed the stop
    assert stopped.text == whole.text[: whole.text.index(word)]


def test_rows_of_one_call_stop_each_at_their_own_stop_sequence(
    model: tuple[TransformersPredictor, list[int]], roomy: TransformersPredictor
) -> None:
    ids = model[1]
    (whole,) = run_predictor(roomy, [_ask(ids, max_tokens=20, logprobs=True)])
    assert isinstance(whole, Prediction)
    assert whole.logprobs is not None
    early, late = whole.text.split()[1], whole.text.split()[5]
    ends = _through(whole.logprobs, early), _through(whole.logprobs, late)
    assert ends[0] < ends[1] - 2  # the early stop's row is done a yield point or more before the late one's
    waiting = [0]
    yielding = TransformersPredictor(roomy.model_path, max_new_tokens=64, max_tokens_cap=64, yield_tokens=2)
    yielding.setup("cpu")
    yielding.yield_to(lambda: waiting[0], max_rows=8)
    # the early stop's row is done first: the call stops at the yield point after it, the other row goes on
    first, second = run_predictor(
        yielding, [_ask(ids, max_tokens=20, stop=[early]), _ask(ids, max_tokens=20, stop=[late])]
    )
    assert isinstance(first, Prediction)
    assert (first.finish_reason, first.completion_tokens) == ("stop", ends[0])
    assert isinstance(second, Continued)
    assert len(second.generated) == -(-ends[0] // 2) * 2  # the first yield point at or after the early stop
    went_on, _ = _until_done(yielding, _ask(ids, max_tokens=20, stop=[late]).continued(second))
    assert (went_on.finish_reason, went_on.completion_tokens) == ("stop", ends[1])
    assert went_on.text == whole.text[: whole.text.index(late)]


def test_seeded_sampling_repeats_itself(model: tuple[TransformersPredictor, list[int]]) -> None:
    predictor, ids = model
    first, second = (
        run_predictor(predictor, [_ask(ids, max_tokens=12, temperature=1.5, top_p=0.95, seed=7)])[0] for _ in range(2)
    )
    assert isinstance(first, Prediction)
    assert isinstance(second, Prediction)
    assert first.text == second.text


def test_n_answers_with_their_tokens_log_probabilities(model: tuple[TransformersPredictor, list[int]]) -> None:
    predictor, ids = model
    params = {"max_tokens": 4, "temperature": 1.0, "seed": 3, "n": 2, "logprobs": True, "top_logprobs": 3}
    (answer,) = run_predictor(predictor, [_ask(ids, **params)])
    assert isinstance(answer, Prediction)
    (other,) = answer.more
    assert answer.completion_tokens == 8  # both answers' tokens
    for choice in (answer, other):
        assert choice.logprobs is not None
        assert len(choice.logprobs) == 4  # one entry per token
        assert "".join(entry["token"] for entry in choice.logprobs) == choice.text
        for entry in choice.logprobs:
            assert entry["logprob"] <= 0
            assert bytes(entry["bytes"]).decode() == entry["token"]
            top = entry["top_logprobs"]
            assert len(top) == 3
            assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
            assert entry["logprob"] <= top[0]["logprob"]


def test_an_answer_stops_where_the_context_is_full(model: tuple[TransformersPredictor, list[int]]) -> None:
    predictor, ids = model
    predictor.max_context_tokens = len(ids) + 5
    try:
        (full,) = run_predictor(predictor, [_ask(ids, max_tokens=20)])
    finally:
        predictor.max_context_tokens = None
    assert isinstance(full, Prediction)
    assert (full.completion_tokens, full.finish_reason) == (5, "length")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 8},
        "pages": {"type": "integer", "minimum": 1, "maximum": 999},
        "long": {"type": "boolean"},
    },
    "required": ["title", "pages", "long"],
    "additionalProperties": False,
}


def test_one_call_holds_each_answer_to_its_own_schema_call_or_nothing(
    model: tuple[TransformersPredictor, list[int]], roomy: TransformersPredictor
) -> None:
    predictor, ids = roomy, model[1]
    schema = {"type": "json_schema", "json_schema": {"name": "book", "schema": ANSWER_SCHEMA, "strict": True}}
    forced = {"type": "function", "function": {"name": "get_weather"}}
    structured, called, free = run_predictor(
        predictor,
        [
            _ask(ids, max_tokens=48, response_format=schema),
            _ask(ids, max_tokens=48, tools=[WEATHER], tool_choice=forced),
            _ask(ids, max_tokens=6),
        ],
    )
    assert isinstance(structured, Prediction)
    assert isinstance(called, Prediction)
    assert isinstance(free, Prediction)
    book = json.loads(structured.text)
    assert set(book) == {"title", "pages", "long"}
    assert isinstance(book["title"], str)
    assert isinstance(book["pages"], int)
    assert 1 <= book["pages"] <= 999
    assert len(book["title"]) <= 8
    assert structured.finish_reason == "stop"
    assert isinstance(book["long"], bool)
    assert called.finish_reason == "tool_calls"
    assert called.text == ""
    assert called.tool_calls is not None
    (call,) = called.tool_calls
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}
    assert free.tool_calls is None
    assert not free.text.startswith("{")


def _derailed(token: int) -> type[RowGrammar]:
    """A row grammar whose first row writes `token` as its third, whatever its grammar allows (as when the grammar
    engine and the model fall out of step)."""

    class Derailed(RowGrammar):
        made = 0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.first, self.masks = Derailed.made == 0, 0
            Derailed.made += 1

        def mask(self, scores: Any, torch: Any) -> Any:
            scores = super().mask(scores, torch)
            self.masks += 1
            if self.first and self.masks == 3:
                scores = torch.full_like(scores, float("-inf"))
                scores[token] = 0.0
            return scores

    return Derailed


def test_a_row_that_breaks_its_grammar_mid_answer_is_ended_and_fails_alone(
    model: tuple[TransformersPredictor, list[int]], roomy: TransformersPredictor, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = model[1]
    schema = {"type": "json_schema", "json_schema": {"name": "book", "schema": ANSWER_SCHEMA, "strict": True}}
    (newline,) = roomy._tokenizer.encode("\n", add_special_tokens=False)  # never in compact JSON, nor in a string
    monkeypatch.setattr(engine, "RowGrammar", _derailed(newline))
    structured = _ask(ids, max_tokens=48, response_format=schema)
    broken, kept, free = run_predictor(roomy, [structured, structured, _ask(ids, max_tokens=6)])
    assert isinstance(broken, InferenceFailed)  # not an answer that went on unconstrained
    assert broken.to_dict()["code"] == "inference_failed"
    assert f"refused token {newline}" in broken.message
    assert isinstance(kept, Prediction)  # the call's other rows: answered as ever
    assert set(json.loads(kept.text)) == {"title", "pages", "long"}
    assert isinstance(free, Prediction)
    assert free.completion_tokens == 6


def test_a_streamed_request_sends_its_answer_while_the_call_generates(
    model: tuple[TransformersPredictor, list[int]],
) -> None:
    predictor, ids = model
    sent: list[tuple[str, str]] = []
    predictor.pieces = lambda job_id, piece: sent.append((job_id, piece))
    try:
        streamed_request = ModelRequest(ids, params=GenerationParams(max_tokens=12), stream_to="job-s")
        batch = predictor.batch([streamed_request, _ask(ids)])
        generated = predictor.predict(batch)
        during = list(sent)  # before the answers are taken apart: what went out while it generated
        streamed, whole = predictor.unbatch(generated)
    finally:
        predictor.pieces = None
    assert isinstance(streamed, Prediction), streamed
    assert isinstance(whole, Prediction), whole
    assert len(during) >= 3
    assert {job for job, _ in sent} == {"job-s"}  # the row that was not streamed sent nothing
    assert "".join(piece for _, piece in sent) == streamed.text
    assert whole.text.startswith(streamed.text)


def _until_done(predictor: TransformersPredictor, request: ModelRequest) -> tuple[Prediction, int]:
    """Run a request call after call until its answer is done; the answer and the calls it took."""
    calls = 0
    while True:
        calls += 1
        (outcome,) = run_predictor(predictor, [request])
        if isinstance(outcome, Prediction):
            return outcome, calls
        assert isinstance(outcome, Continued)
        request = request.continued(outcome)


def test_a_call_yields_between_steps_and_an_answer_goes_on_where_it_was(
    model: tuple[TransformersPredictor, list[int]], roomy: TransformersPredictor
) -> None:
    ids = model[1]
    (whole,) = run_predictor(roomy, [_ask(ids, max_tokens=20)])
    assert isinstance(whole, Prediction)
    waiting = [0]
    yielding = TransformersPredictor(roomy.model_path, max_new_tokens=64, max_tokens_cap=64, yield_tokens=4)
    yielding.setup("cpu")
    yielding.yield_to(lambda: waiting[0], max_rows=8)
    # answers that end unevenly: the call stops at the yield point after the short answer's end, so its client
    # does not wait for the long one (which goes on in the next call)
    short, long = run_predictor(yielding, [_ask(ids, max_tokens=3), _ask(ids, max_tokens=20)])
    assert isinstance(short, Prediction)
    assert short.completion_tokens == 3
    assert isinstance(long, Continued)
    assert len(long.generated) == 4
    alone, calls = _until_done(yielding, _ask(ids, max_tokens=20))
    assert calls == 1  # alone, with nobody waiting, a call runs to its end
    waiting[0] = 1
    went_on, calls = _until_done(yielding, _ask(ids, max_tokens=20))
    assert calls == 5  # a request waited at every yield point: 4 tokens a call
    assert (went_on.text, went_on.completion_tokens, went_on.finish_reason) == (whole.text, 20, "length")
    assert (alone.text, alone.completion_tokens) == (whole.text, 20)


def _until_all_done(predictor: TransformersPredictor, requests: list[ModelRequest]) -> tuple[list[Prediction], int]:
    """Run requests together call after call, each unfinished one going on, until every answer is done; the answers
    and the calls it took."""
    answers: dict[int, Prediction] = {}
    going = dict(enumerate(requests))
    calls = 0
    while going:
        calls += 1
        for position, outcome in zip(list(going), run_predictor(predictor, list(going.values())), strict=True):
            if isinstance(outcome, Continued):
                going[position] = going[position].continued(outcome)
            else:
                assert isinstance(outcome, Prediction), outcome
                answers[position] = outcome
                del going[position]
    return [answers[i] for i in range(len(requests))], calls


def test_a_seeded_sampled_answer_is_the_same_alone_and_beside_other_traffic(
    model: tuple[TransformersPredictor, list[int]],
) -> None:
    ids = model[1]
    other = [*ids[:-4], *ids[-2:]]  # another prompt, asked with the same sampling parameters: the same call
    asked = {"max_tokens": 8, "temperature": 1.5, "top_p": 0.95, "seed": 11}
    waiting = [0]
    yielding = TransformersPredictor(model[0].model_path, max_new_tokens=8, max_tokens_cap=8, yield_tokens=2)
    yielding.setup("cpu")
    yielding.yield_to(lambda: waiting[0], max_rows=8)
    alone, calls = _until_done(yielding, _ask(ids, **asked))
    assert calls == 1
    assert alone.completion_tokens == 8
    waiting[0] = 1  # other traffic: a request waits at every yield point, another answer shares each call
    (beside, _), calls = _until_all_done(yielding, [_ask(ids, **asked), _ask(other, **asked)])
    assert calls == 4  # it stopped every 2 tokens and went on
    assert (beside.text, beside.completion_tokens) == (alone.text, alone.completion_tokens)
    waiting[0] = 0
    (reseeded,) = run_predictor(yielding, [_ask(ids, **{**asked, "seed": 12})])
    assert isinstance(reseeded, Prediction)
    assert reseeded.text != alone.text  # the seed chooses the answer


def test_a_streamed_answer_that_goes_on_sends_each_piece_once(model: tuple[TransformersPredictor, list[int]]) -> None:
    ids = model[1]
    sent: list[str] = []
    yielding = TransformersPredictor(model[0].model_path, max_new_tokens=16, max_tokens_cap=24, yield_tokens=3)
    yielding.setup("cpu")
    yielding.yield_to(lambda: 1, max_rows=8)
    yielding.pieces = lambda job_id, piece: sent.append(piece)
    request = ModelRequest(ids, params=GenerationParams(max_tokens=12), stream_to="job-s")
    answer, calls = _until_done(yielding, request)
    assert calls == 4
    assert "".join(sent) == answer.text
    assert len(sent) >= 4


def test_a_stop_sequence_ends_an_answer_held_to_a_schema_without_failing_it(
    model: tuple[TransformersPredictor, list[int]], roomy: TransformersPredictor
) -> None:
    """A row its stop ended is padded from then on: its grammar reads none of that, so the answer is not failed
    as one that broke its format."""
    schema = {"type": "json_schema", "json_schema": {"name": "book", "schema": ANSWER_SCHEMA, "strict": True}}
    structured, stopped = run_predictor(
        roomy,
        [
            _ask(model[1], max_tokens=48, response_format=schema, logprobs=True),
            _ask(model[1], max_tokens=48, response_format=schema, logprobs=True, stop=['"pages"']),
        ],
    )
    assert isinstance(structured, Prediction)
    assert structured.logprobs is not None
    assert isinstance(stopped, Prediction)
    assert (stopped.finish_reason, stopped.completion_tokens) == ("stop", _through(structured.logprobs, '"pages"'))
    assert stopped.text == structured.text[: structured.text.index('"pages"')]


def test_a_request_that_joins_between_calls_reads_its_prompt_once_and_the_answer_going_on_none_again(
    model: tuple[TransformersPredictor, list[int]],
) -> None:
    ids = model[1]
    other = [*ids[:-4], *ids[-2:]]
    waiting = [1]
    engine = TransformersPredictor(model[0].model_path, max_new_tokens=8, max_tokens_cap=8, yield_tokens=2)
    engine.setup("cpu")
    engine.yield_to(lambda: waiting[0], max_rows=8)
    (first,) = run_predictor(engine, [_ask(ids, max_tokens=8)])
    assert isinstance(first, Continued)
    assert len(first.generated) == 2  # a request waited: the call stopped at its first yield point
    assert engine.tokens_fed == len(ids) + 1  # the prompt, then the first answer token
    engine.yield_tokens = 0  # the next call runs to its end
    going_on = _ask(ids, max_tokens=8).continued(first)
    answer, joined = run_predictor(engine, [going_on, _ask(other, max_tokens=8)])
    assert isinstance(answer, Prediction)
    assert isinstance(joined, Prediction)
    # the answer went on from its kept cache: its prompt and its tokens so far were never fed again
    fed = len(ids) + len(other) + (answer.completion_tokens - 1) + (joined.completion_tokens - 1)
    assert engine.tokens_fed == fed
    (alone,) = run_predictor(engine, [_ask(ids, max_tokens=8)])
    assert isinstance(alone, Prediction)
    assert answer.text == alone.text


def test_the_generate_path_kept_for_comparison_answers_as_the_engine_does(
    model: tuple[TransformersPredictor, list[int]],
) -> None:
    predictor, ids = model
    restarted = TransformersPredictor(predictor.model_path, max_new_tokens=16, max_tokens_cap=24, engine=False)
    restarted.setup("cpu")
    asked = [_ask(ids, max_tokens=10), _ask([*ids[:-4], *ids[-2:]], max_tokens=6)]
    engine_answers = run_predictor(predictor, asked)
    generate_answers = run_predictor(restarted, asked)
    assert restarted.tokens_fed == 0  # no engine behind it
    assert predictor.tokens_fed > 0
    for ours, theirs in zip(engine_answers, generate_answers, strict=True):
        assert isinstance(ours, Prediction)
        assert isinstance(theirs, Prediction)
        assert (ours.text, ours.completion_tokens) == (theirs.text, theirs.completion_tokens)


@pytest.fixture(scope="module")
def base_url(workers: dict[str, Path]) -> Iterator[str]:
    """The API over the session's workers (their inference worker runs the built-in model on the decode engine)."""
    with serve(create_app(ApiSettings(max_tokens_cap=ROOMY_TOKENS))) as base:
        yield base


def test_a_job_cancelled_while_its_answer_generates_beside_another_stops_there(
    base_url: str, store_redis: redis.Redis[bytes]
) -> None:
    story: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Write a long story about a dragon and a castle."}
    ]
    model = ApiSettings().public_model_name
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        # Two streamed answers of the cap's length, greedy, on the device together; nothing else arrives, so the
        # call they share never yields: before the engine asked for cancellations, the cancelled one ran as long
        # as the other.
        kept = client.chat.completions.create(
            model=model, messages=story, max_tokens=ROOMY_TOKENS, stream=True, temperature=0
        )
        other = next(iter(kept)).id.removeprefix("chatcmpl-")
        dropped = client.chat.completions.create(
            model=model, messages=story, max_tokens=ROOMY_TOKENS, stream=True, temperature=0
        )
        written = next(c for c in dropped if c.choices and c.choices[0].delta.content)  # it generates
        job_id = written.id.removeprefix("chatcmpl-")
        assert httpx.delete(f"{base_url}/v1/jobs/{job_id}", timeout=30).json()["status"] == "cancelled"
        rest = list(kept)
        dropped.close()
    assert rest[-1].choices[0].finish_reason == "length"  # the other answer went on to its end
    kept_pieces = store_redis.xlen(answer_key(other))
    dropped_pieces = store_redis.xlen(answer_key(job_id))
    assert kept_pieces >= ROOMY_TOKENS // 2
    # the cancelled answer's row left the running call soon after the cancel, well before the other ended
    assert 0 < dropped_pieces < kept_pieces // 2
    assert httpx.get(f"{base_url}/v1/jobs/{job_id}", timeout=30).json()["status"] == "cancelled"
