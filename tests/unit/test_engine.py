"""The local model's decode engine: rows keep their KV cache across steps, join and leave between steps, and each
answers as it would alone (the real SmolLM2 on the CPU)."""

from __future__ import annotations

import json
import time
from collections.abc import Hashable
from typing import Any

import pytest

from stoker.adapters.backends.engine import DecodeEngine
from stoker.adapters.backends.engine_rows import EngineFull, EngineRequest, Finished
from stoker.adapters.backends.grammar import grammar_for, token_grammar
from stoker.adapters.backends.local import TransformersPredictor
from stoker.adapters.backends.modelstore import resolve_model
from stoker.adapters.backends.tokenizer import PromptTokenizer, load_tokenizer
from stoker.core.errors import InferenceFailed
from stoker.core.model import Continued, GenerationParams, ModelRequest, Prediction, run_predictor
from stoker.core.prompting import build_prompt
from stoker.core.tools import ResponseFormat
from stoker.settings import WorkerSettings

pytestmark = pytest.mark.real_model


class Loaded:
    """The built-in model and tokenizer on the CPU, and two prompts."""

    def __init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        settings = WorkerSettings()
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        path = str(resolve_model(settings.model, settings.model_cache, fetch=False))
        self.tokenizer = load_tokenizer(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts = PromptTokenizer(self.tokenizer)
        self.story = build_prompt(prompts, "Write a long story about a dragon and a castle.", [], 512).ids
        self.short = build_prompt(prompts, "Name a colour.", [], 512).ids
        self._grammar: Any = None

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def grammar_tokenizer(self) -> Any:
        if self._grammar is None:
            self._grammar = token_grammar(self.tokenizer)
        return self._grammar

    def engine(self, max_rows: int = 8, pieces: Any = None) -> DecodeEngine:
        stop = {int(self.tokenizer.eos_token_id), int(self.tokenizer.pad_token_id or self.tokenizer.eos_token_id)}
        return DecodeEngine(
            self.model, self.decode, stop, max_rows=max_rows, grammar_tokenizer=self.grammar_tokenizer, pieces=pieces
        )

    def solo(self, ids: list[int], new: int) -> list[int]:
        """What `generate` answers greedily for one prompt alone."""
        import torch

        with torch.inference_mode():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)
        answer: list[int] = out[0, len(ids) :].tolist()
        eos = int(self.tokenizer.eos_token_id)
        return answer[: answer.index(eos)] if eos in answer else answer


@pytest.fixture(scope="module")
def loaded() -> Loaded:
    return Loaded()


def run(engine: DecodeEngine, most_steps: int = 200) -> dict[Hashable, Finished]:
    """Step the engine until nothing runs; every finished request by key."""
    done: dict[Hashable, Finished] = {}
    for _ in range(most_steps):
        if not engine.busy:
            break
        for finished in engine.step():
            done[finished.key] = finished
    return done


def test_greedy_rows_equal_a_solo_generate_and_each_prompt_is_read_once(loaded: Loaded) -> None:
    engine = loaded.engine()
    engine.submit(EngineRequest("story", loaded.story, limit=12))
    engine.step()
    engine.step()  # the story is two tokens in when the short one joins
    engine.submit(EngineRequest("short", loaded.short, limit=6))
    done = run(engine)
    story, short = done["story"].rows[0], done["short"].rows[0]
    assert story.tokens == loaded.solo(loaded.story, 12)
    assert short.tokens == loaded.solo(loaded.short, 6)
    # each prompt once, and each answer token but the last fed once (the last is chosen, never fed)
    fed = len(loaded.story) + len(loaded.short) + len(story.tokens) - 1 + len(short.tokens) - 1
    assert engine.fed == fed
    assert engine.rows == 0


def test_a_seeded_sampled_answer_is_the_same_alone_and_beside_other_traffic(loaded: Loaded) -> None:
    params = GenerationParams(temperature=0.9, top_p=0.95, seed=7)
    alone = loaded.engine()
    alone.submit(EngineRequest("a", loaded.story, params, limit=10))
    expected = run(alone)["a"].rows[0].tokens
    crowded = loaded.engine()
    crowded.submit(EngineRequest("other", loaded.short, GenerationParams(temperature=1.0, seed=1), limit=4))
    crowded.submit(EngineRequest("third", loaded.story, limit=3))
    crowded.step()
    crowded.submit(EngineRequest("a", loaded.story, params, limit=10))
    assert run(crowded)["a"].rows[0].tokens == expected
    other_seed = loaded.engine()
    other_seed.submit(EngineRequest("a", loaded.story, params.model_copy(update={"seed": 8}), limit=10))
    assert run(other_seed)["a"].rows[0].tokens != expected


def test_n_answers_read_their_prompt_once_and_carry_log_probabilities(loaded: Loaded) -> None:
    engine = loaded.engine()
    params = GenerationParams(temperature=1.0, seed=3, n=3, logprobs=True, top_logprobs=2)
    engine.submit(EngineRequest("n", loaded.short, params, limit=5))
    rows = run(engine)["n"].rows
    assert [row.answer for row in rows] == [0, 1, 2]
    assert len({tuple(row.tokens) for row in rows}) > 1  # each answer draws its own
    assert engine.fed == len(loaded.short) + sum(len(row.tokens) - 1 for row in rows)
    for row in rows:
        assert len(row.steps) >= len(row.tokens)
        for (_token, logprob), top in row.steps[: len(row.tokens)]:
            assert logprob <= 0
            assert len(top) == 2
            assert top[0][1] >= logprob  # the likeliest is at least as likely as the one drawn
        assert [step[0][0] for step in row.steps[: len(row.tokens)]] == row.tokens


def test_a_stop_sequence_ends_its_row_at_the_token_that_completes_it(loaded: Loaded) -> None:
    whole = loaded.solo(loaded.story, 12)
    word = loaded.decode(whole).split()[2]
    engine = loaded.engine()
    engine.submit(EngineRequest("s", loaded.story, GenerationParams(stop=(word,)), limit=12))
    (row,) = run(engine)["s"].rows
    assert row.end == "stop"
    assert word in loaded.decode(row.tokens)
    assert word not in loaded.decode(row.tokens[:-1])
    assert row.tokens == whole[: len(row.tokens)]


def test_a_row_held_to_a_schema_writes_json_of_it(loaded: Loaded) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}
    format_ = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}
    )
    params = GenerationParams(response_format=format_)
    engine = loaded.engine()
    engine.submit(EngineRequest("free", loaded.short, limit=20))
    engine.submit(EngineRequest("json", loaded.short, params, limit=40, grammar=grammar_for(params)))
    done = run(engine)
    answer = json.loads(loaded.decode(done["json"].rows[0].tokens))
    assert isinstance(answer["colour"], str)
    assert done["json"].rows[0].failure is None
    assert done["free"].rows[0].tokens == loaded.solo(loaded.short, 20)


def test_a_streamed_row_sends_its_text_as_it_grows(loaded: Loaded) -> None:
    pieces: list[tuple[str, str]] = []
    engine = loaded.engine(pieces=lambda job, piece: pieces.append((job, piece)))
    engine.submit(EngineRequest("s", loaded.story, limit=10, stream_to="job-1"))
    engine.step()
    engine.step()
    assert pieces  # sent while it generates
    (row,) = run(engine)["s"].rows
    assert {job for job, _ in pieces} == {"job-1"}
    assert loaded.decode(row.tokens).startswith("".join(piece for _, piece in pieces))


def test_a_cancelled_row_leaves_at_the_next_step(loaded: Loaded) -> None:
    engine = loaded.engine()
    engine.submit(EngineRequest("stays", loaded.story, limit=8))
    engine.submit(EngineRequest("goes", loaded.story, limit=50))
    engine.step()
    engine.step()
    assert engine.rows == 2
    engine.cancel("goes")
    (finished,) = engine.step()
    assert finished.key == "goes"
    assert finished.rows[0].end == "cancelled"
    assert engine.rows == 1
    late = EngineRequest("late", loaded.story, limit=50, deadline=time.time() - 1)
    engine.submit(late)
    assert [f.key for f in engine.step()] == ["late"]
    assert run(engine)["stays"].rows[0].tokens == loaded.solo(loaded.story, 8)


def test_a_job_cancelled_mid_call_stops_being_fed_at_the_next_step(loaded: Loaded) -> None:
    settings = WorkerSettings()
    predictor = TransformersPredictor(
        str(resolve_model(settings.model, settings.model_cache, fetch=False)), max_new_tokens=64, max_tokens_cap=64
    )
    predictor.setup("cpu")
    asked: list[str] = []

    def cancelled(job_id: str) -> bool:  # the consumer hears "goes" cancelled after the call's third step
        asked.append(job_id)
        return job_id == "goes" and asked.count("goes") > 3

    predictor.yield_to(lambda: 0, max_rows=4, cancelled=cancelled)
    stays = ModelRequest(loaded.story, params=GenerationParams(max_tokens=12), job_id="stays")
    goes = ModelRequest(loaded.story, params=GenerationParams(max_tokens=40), job_id="goes")
    kept, dropped = run_predictor(predictor, [stays, goes])
    assert isinstance(dropped, InferenceFailed)
    assert isinstance(kept, Prediction)
    assert kept.text == loaded.decode(loaded.solo(loaded.story, 12))
    assert asked.count("goes") == 4  # asked before each step until it answered yes, never after
    # both prompts once; "stays" fed each answer token but its last; "goes" fed the two tokens it chose in the
    # steps before it was dropped (its third, chosen then too, never fed)
    assert predictor.tokens_fed == 2 * len(loaded.story) + (12 - 1) + 2


def test_the_engine_never_holds_more_rows_than_its_room(loaded: Loaded) -> None:
    engine = loaded.engine(max_rows=3)
    engine.submit(EngineRequest("a", loaded.short, GenerationParams(n=2, temperature=1.0), limit=4))
    with pytest.raises(EngineFull):
        engine.submit(EngineRequest("b", loaded.short, GenerationParams(n=2, temperature=1.0), limit=4))
    engine.submit(EngineRequest("c", loaded.short, limit=4))
    assert engine.room == 0
    most = 0
    while engine.busy:
        engine.step()
        most = max(most, engine.rows)
    assert most <= 3
    assert engine.room == 3


def test_a_parked_request_goes_on_from_its_cache_without_reading_its_prompt_again(loaded: Loaded) -> None:
    engine = loaded.engine()
    engine.submit(EngineRequest("first", loaded.story, limit=10))
    for _ in range(4):
        engine.step()
    (row,) = engine.park("first")
    assert engine.rows == 0
    fed = engine.fed
    engine.submit(EngineRequest("again", loaded.story, limit=10, generated=tuple(row.tokens)))
    done = run(engine)
    assert done["again"].rows[0].tokens == loaded.solo(loaded.story, 10)
    assert engine.fed - fed == 10 - 4  # the answer's tokens from where it was, never the prompt


def test_requests_alike_are_parked_each_with_its_own_cache(loaded: Loaded) -> None:
    engine = loaded.engine()
    engine.submit(EngineRequest("one", loaded.short, limit=6))
    engine.submit(EngineRequest("two", loaded.short, limit=6))
    engine.step()
    engine.step()
    rows = [*engine.park("one"), *engine.park("two")]
    assert [len(row.tokens) for row in rows] == [2, 2]
    fed = engine.fed
    for key, row in zip(("again-1", "again-2"), rows, strict=True):
        engine.submit(EngineRequest(key, loaded.short, limit=6, generated=tuple(row.tokens)))
    done = run(engine)
    assert engine.fed - fed == 2 * (6 - 2)  # neither read its prompt again
    assert done["again-1"].rows[0].tokens == done["again-2"].rows[0].tokens == loaded.solo(loaded.short, 6)


def test_a_request_with_more_answers_than_the_room_runs_alone(loaded: Loaded) -> None:
    engine = loaded.engine(max_rows=1)
    engine.submit(EngineRequest("n", loaded.short, GenerationParams(n=2, temperature=1.0, seed=5), limit=3))
    with pytest.raises(EngineFull):
        engine.submit(EngineRequest("next", loaded.short, limit=3))
    assert [row.answer for row in run(engine)["n"].rows] == [0, 1]


def test_a_prompt_joining_running_rows_is_read_in_chunks_while_they_go_on(loaded: Loaded) -> None:
    stop = {int(loaded.tokenizer.eos_token_id)}
    engine = DecodeEngine(loaded.model, loaded.decode, stop, max_rows=4, prefill_chunk=8)
    engine.submit(EngineRequest("story", loaded.story, limit=24))
    engine.step()
    (story,) = engine._rows
    engine.submit(EngineRequest("short", loaded.short, limit=6))
    engine.submit(EngineRequest("dropped", loaded.short, limit=6))
    engine.step()  # the two prompts, read together: 4 tokens of each this step
    assert engine.rows == 1
    engine.cancel("dropped")  # cancelled while its prompt is read: it leaves at the next step, unanswered
    finished, reads = [], 0
    while engine.rows < 2:
        before = len(story.tokens)
        finished += [(f.key, f.rows) for f in engine.step()]
        reads += 1
        assert len(story.tokens) == before + 1  # the running row gets its token at every step of the read
    assert finished == [("dropped", [])]
    assert reads == -(-(len(loaded.short) - 4) // 8)  # the rest of the short prompt, 8 tokens a step
    done = run(engine)
    assert done["story"].rows[0].tokens == loaded.solo(loaded.story, 24)
    assert done["short"].rows[0].tokens == loaded.solo(loaded.short, 6)
    # each prompt once (the cancelled one: the 4 tokens read before it left), each answer token but the last once
    answers = sum(len(done[key].rows[0].tokens) - 1 for key in ("story", "short"))
    assert engine.fed == len(loaded.story) + len(loaded.short) + 4 + answers


def test_a_call_that_yields_every_step_never_stops_while_a_prompt_is_read(loaded: Loaded) -> None:
    settings = WorkerSettings()
    path = str(resolve_model(settings.model, settings.model_cache, fetch=False))
    predictor = TransformersPredictor(path, max_new_tokens=12, max_tokens_cap=12, yield_tokens=1, prefill_chunk=8)
    predictor.setup("cpu")
    predictor.yield_to(lambda: 1, max_rows=4)  # a request always waits: every call stops as soon as it may
    story = ModelRequest(loaded.story, params=GenerationParams(max_tokens=12))
    (going,) = run_predictor(predictor, [story])
    assert isinstance(going, Continued)
    pending: list[ModelRequest] = [story.continued(going), ModelRequest(loaded.short)]
    answers: list[Prediction] = []
    while pending:  # the consumer's loop: what goes on, in the next call
        outcomes = run_predictor(predictor, pending)
        answers += [o for o in outcomes if isinstance(o, Prediction)]
        pending = [r.continued(o) for r, o in zip(pending, outcomes, strict=True) if isinstance(o, Continued)]
    assert sorted(a.text for a in answers) == sorted(
        [loaded.decode(loaded.solo(loaded.story, 12)), loaded.decode(loaded.solo(loaded.short, 12))]
    )
    # the short prompt, read 8 tokens a step beside the story's row, read once: the call went on until it was read
    tokens = sum(a.completion_tokens - 1 for a in answers)
    assert predictor.tokens_fed == len(loaded.story) + len(loaded.short) + tokens
