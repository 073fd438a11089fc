"""The stage cache on real workers: repeats hit, changed content misses, twins compute once, a lost cache costs
only work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
from fastapi.testclient import TestClient

from api.app import create_app
from stoker.adapters.cache import StageCache
from stoker.adapters.store.keys import cache_key, cache_lease_key
from stoker.core.cachekeys import CacheAddress, prompt_address
from stoker.core.media import content_hash
from stoker.core.tenancy import cache_scope
from stoker.runtime.context import WorkerContext
from stoker.runtime.stage import LEASE_S, through_cache
from stoker.settings import ApiSettings, CommonSettings, WorkerSettings
from tests.fakes.outbox import NoOutbox
from tests.fleet import client_context, own_fleet
from tests.integration.conftest import SpySubmitter
from tests.integration.test_pipeline import _wait
from tests.media import long_speech_wav, text_image
from workers.procs import ROOT, wait_for


def _stats() -> dict[str, dict[str, float]]:
    return StageCache.connect(CommonSettings()).stats()


def _count(stats: dict[str, dict[str, float]], stage: str, what: str) -> float:
    return stats.get(stage, {}).get(what, 0.0)


def _post(client: TestClient, name: str, data: bytes, prompt: str = "What does it say?") -> dict[str, Any]:
    response = client.post("/v1/jobs", data={"prompt": prompt}, files=[("image", (name, data, "image/png"))])
    assert response.status_code == 202, response.text
    return _wait(client, response.json()["id"])


def test_a_repeated_image_skips_preprocessing(client: TestClient, spy: SpySubmitter) -> None:
    image = text_image("REPEAT 31")
    first_job = _post(client, "a.png", image)
    before = _stats()
    _until_tokenizer_loaded(client)
    # Its input cached, a new prompt: tokenized in the API, one hop to the inference queue.
    second_job = _post(client, "b.png", image, prompt="And again?")
    third_job = _post(client, "c.png", image)  # the first job's prompt as well: nothing left to prepare
    assert [spy.starts[j["id"]] for j in (first_job, second_job, third_job)] == ["preprocess", "infer", "infer"]
    assert third_job["status"] == "succeeded"
    assert third_job["inputs"][0]["text"] == first_job["inputs"][0]["text"]
    first, second = first_job["inputs"][0], second_job["inputs"][0]
    assert first["cache_hit"] == {"decode": False, "ocr": False}
    assert second["cache_hit"] == {"decode": True, "ocr": True}
    assert second["timings_ms"] == {}  # no stage ran for it: the whole input came from the cache
    assert second["text"] == first["text"]
    assert "REPEAT" in second["text"]
    assert _stats().get("ocr") == before.get("ocr")  # no OCR task even looked
    assert second_job["status"] == "succeeded"
    assert second_job["timings_ms"]["preprocess"] <= 0.25 * first_job["timings_ms"]["preprocess"]


def test_without_a_tokenizer_the_api_sends_cached_inputs_to_tokenize(spy: SpySubmitter, client: TestClient) -> None:
    image = text_image("HOP 12")
    _post(client, "a.png", image)
    with TestClient(create_app(ApiSettings(api_tokenize=False), submitter=spy)) as plain:
        job = _post(plain, "b.png", image, prompt="Another question?")
    assert spy.starts[job["id"]] == "tokenize"
    assert job["status"] == "succeeded"
    assert job["inputs"][0]["cache_hit"] == {"decode": True, "ocr": True}


def _until_tokenizer_loaded(client: TestClient, timeout_s: float = 60.0) -> None:
    """The API loads its tokenizer in the background at start, and samples the queues: until it has both, cheap
    jobs take the tokenize queue (without a fresh view of the inference queue, the one hop is not taken)."""
    context = client_context(client)
    wait_for(lambda: context.prompts.loaded, timeout_s, "the API's tokenizer", [])
    wait_for(lambda: context.monitor.fresh() is not None, timeout_s, "the API's first queue sample", [])


def test_a_cached_stage_answers_in_a_fraction_of_its_cost(client: TestClient) -> None:
    image = text_image("STAGE 77")
    first = _post(client, "a.png", image)["inputs"][0]
    resources_cache = redis.Redis.from_url(os.environ["STOKER_CACHE_URL"])
    for key in resources_cache.scan_iter("stoker:cache:input:*"):
        resources_cache.delete(key)  # forget the whole input; the per-stage results stay
    resources_cache.close()
    second = _post(client, "b.png", image)["inputs"][0]
    assert second["cache_hit"] == {"decode": True, "ocr": True}
    assert second["timings_ms"]["ocr"] <= 0.1 * first["timings_ms"]["ocr"]


def test_same_name_new_bytes_misses_and_same_bytes_new_name_hits(client: TestClient) -> None:
    one = _post(client, "scan.png", text_image("FIRST 1"))["inputs"][0]
    two = _post(client, "scan.png", text_image("SECOND 2"))["inputs"][0]
    three = _post(client, "renamed.png", text_image("SECOND 2"))["inputs"][0]
    assert "FIRST" in one["text"]
    assert two["cache_hit"]["ocr"] is False
    assert "SECOND" in two["text"]
    assert three["cache_hit"]["ocr"] is True
    assert three["text"] == two["text"]


def test_twenty_twins_run_ocr_once(client: TestClient) -> None:
    image = text_image("TWINS 20")
    before = _stats()

    def submit(_: int) -> str:
        response = client.post("/v1/jobs", data={"prompt": "Read."}, files=[("image", ("t.png", image, "image/png"))])
        assert response.status_code == 202
        return str(response.json()["id"])

    with ThreadPoolExecutor(max_workers=10) as pool:
        ids = list(pool.map(submit, range(20)))
    jobs = [_wait(client, job_id) for job_id in ids]
    assert all(job["status"] == "succeeded" for job in jobs)
    assert all("TWINS" in job["inputs"][0]["text"] for job in jobs)
    ran_ocr_task = sum(1 for job in jobs if "ocr" in job["inputs"][0]["timings_ms"])  # the rest came whole
    after = _stats()
    assert _count(after, "ocr", "misses") - _count(before, "ocr", "misses") == 1
    assert _count(after, "ocr", "hits") - _count(before, "ocr", "hits") == ran_ocr_task - 1
    assert _count(after, "decode", "misses") - _count(before, "decode", "misses") == 1


class _FollowerCache(StageCache):
    """A twin's cache that, the first time it goes for the lease after reading a miss, lets another twin run its
    whole flight first (compute, cache the result, let the lease go): the interleaving of two worker processes
    where a follower's read comes before its leader's write and its lease attempt after the leader let go."""

    def __init__(self, twin: Callable[[], object]) -> None:
        settings = CommonSettings()
        client = redis.Redis.from_url(os.environ["STOKER_CACHE_URL"])
        super().__init__(client, ttl_s=settings.cache_ttl_s, max_value_bytes=settings.cache_max_value_bytes)
        self.twin: Callable[[], object] | None = twin

    def _acquire(self, address: CacheAddress, token: str, lease_s: float) -> bool:
        if self.twin is not None:
            twin, self.twin = self.twin, None
            twin()
        return super()._acquire(address, token, lease_s)


def test_a_twin_that_finishes_between_a_followers_read_and_its_lease_is_not_computed_again() -> None:
    address = CacheAddress("decode", "1", uuid.uuid4().hex, "f", "twins")
    computed: list[str] = []

    def twin(name: str, cache: StageCache) -> dict[str, Any]:
        def compute() -> dict[str, Any]:
            computed.append(name)
            return {"features": {"by": name}}

        ctx = WorkerContext(WorkerSettings(), outbox=NoOutbox(), cache=cache)
        return through_cache(ctx, None, address, compute, wait_s=5.0)

    leader = StageCache.connect(CommonSettings())
    follower = _FollowerCache(lambda: twin("leader", leader))
    try:
        shared = twin("follower", follower)
        assert computed == ["leader"]
        assert shared == {"features": {"by": "leader"}}
        assert follower.redis is not None
        assert follower.redis.exists(cache_lease_key(address)) == 0  # nobody holds it once both are done
    finally:
        for cache in (leader, follower):
            if cache.redis is not None:
                cache.redis.delete(cache_key(address), cache_lease_key(address))
                cache.redis.close()


def test_jobs_complete_while_the_cache_is_flushed_under_them(client: TestClient) -> None:
    cache = redis.Redis.from_url(os.environ["STOKER_CACHE_URL"])
    stop = threading.Event()

    def flush_repeatedly() -> None:
        while not stop.is_set():
            cache.flushdb()
            time.sleep(0.02)

    flusher = threading.Thread(target=flush_repeatedly, daemon=True)
    flusher.start()
    try:
        words = [f"FLUSH {n}" for n in range(4)]
        responses = [
            client.post("/v1/jobs", data={"prompt": "Read."}, files=[("image", ("f.png", text_image(w), "image/png"))])
            for w in words
        ]
        jobs = [_wait(client, r.json()["id"]) for r in responses]
    finally:
        stop.set()
        flusher.join()
        cache.close()
    assert [j["status"] for j in jobs] == ["succeeded"] * 4, [j["inputs"][0].get("error") for j in jobs]
    assert all("FLUSH" in j["inputs"][0]["text"] for j in jobs)


def test_a_killed_leader_does_not_block_its_twins(client: TestClient) -> None:
    audio = long_speech_wav(2)  # about 10 s: seconds of work to kill the leader in, and little for its twin to redo
    cache = redis.Redis.from_url(os.environ["STOKER_CACHE_URL"])
    # This recording's lease only: a transcription another test left running holds a lease of its own.
    leases = f"stoker:lease:transcribe:*:{content_hash(audio)}:*"
    # A deadline far past the takeover's: on a slow host the default one could send both jobs on without their
    # audio (degraded) before the lease lapses and a twin transcribes.
    data = {"prompt": "Who?", "deadline_ms": "240000"}
    ids = [
        client.post("/v1/jobs", data=data, files=[("audio", ("s.wav", audio, "audio/wav"))]).json()["id"]
        for _ in range(2)
    ]
    _kill_while_holding(cache, leases)
    jobs = [_wait(client, job_id) for job_id in ids]
    assert [j["status"] for j in jobs] == ["succeeded", "succeeded"], [j["inputs"] for j in jobs]
    texts = [job["inputs"][0]["text"] for job in jobs]
    assert texts[0]
    assert texts[0] == texts[1]  # one transcription, shared
    # The killed leader's lease lapses (within LEASE_S of its last renewal) and the twin let go of its own.
    wait_for(lambda: not list(cache.scan_iter(leases)), LEASE_S + 5, "the leases to be gone", [])
    cache.close()


def _kill_while_holding(cache: redis.Redis[bytes], pattern: str, timeout_s: float = 60.0) -> None:
    """Kill the process that holds a lease matching `pattern` while it holds it: it is stopped first and killed only
    if the lease is still its own (a holder that let go between the lease's read and the signal, its work done, goes
    on: killing it then would leave its twins nothing to take over)."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        for key in cache.scan_iter(pattern):
            token = cache.get(key)
            if token is not None and _stopped(pid := int(token.split(b"-")[0])):
                if cache.get(key) == token:
                    os.kill(pid, signal.SIGKILL)
                    return
                os.kill(pid, signal.SIGCONT)
        time.sleep(0.02)
    raise AssertionError("no transcription lease seen")


def _stopped(pid: int) -> bool:
    """Stop the process (False: it is gone) and wait until it is: a signal lands on its next return from the kernel,
    so a command it was sending reaches the server before the lease is read again."""
    try:
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T", 5, "a stop", [])
    except (ProcessLookupError, FileNotFoundError):
        return False
    return True


def test_a_text_only_job_goes_to_the_model_in_one_hop(client: TestClient, spy: SpySubmitter) -> None:
    _until_tokenizer_loaded(client)
    response = client.post("/v1/jobs", data={"prompt": f"Say hello to {time.time_ns()}."})
    assert response.status_code == 202, response.text
    job = _wait(client, response.json()["id"])
    assert spy.starts[job["id"]] == "infer"  # no tokenize message: tokenized in the API
    assert job["status"] == "succeeded"
    assert job["result"]["prompt_tokens"] > 0
    # Its timings stay truthful: preprocessing (tokenizing in the API) ended before the model started.
    assert 0 <= job["timings_ms"]["preprocess"] <= job["timings_ms"]["total"]


def test_only_a_long_text_only_prompt_is_cached_in_the_api(client: TestClient, spy: SpySubmitter) -> None:
    _until_tokenizer_loaded(client)
    context = client_context(client)
    limit = context.settings.api_tokenize_cache_min_chars
    short = f"Say hello to {time.time_ns()}."
    long = f"Count the words of this ({time.time_ns()}): " + "word " * (limit // 5 + 1)
    assert len(short) <= limit < len(long)
    jobs = {}
    for prompt in (short, short, long, long):
        response = client.post("/v1/jobs", data={"prompt": prompt})
        assert response.status_code == 202, response.text
        job = _wait(client, response.json()["id"])
        assert (job["status"], spy.starts[job["id"]]) == ("succeeded", "infer")  # tokenized in the API each time
        jobs[prompt] = job
    tenant = context.store.jobs.tenant(jobs[short]["id"])
    assert tenant is not None
    scope = cache_scope(tenant, context.settings.cache_shared)
    pipeline = context.cache.context()
    assert pipeline is not None

    def cached(prompt: str) -> dict[str, Any] | None:
        return context.cache.get_json(prompt_address(pipeline, prompt, [], scope))

    assert cached(short) is None  # tokenized again rather than looked up and written
    written = cached(long)
    assert written is not None
    assert len(written["ids"]) == jobs[long]["result"]["prompt_tokens"]  # the prompt the model was given


def _cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "stoker.cli", *args],
        cwd=ROOT,
        env={**env, "COLUMNS": "200"},  # one table row per line
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def _row(table: str, stage: str) -> list[str]:
    """The cells of a stage's row in `stoker cache stats` (stage, hits, misses, rate, saved, spent, oversize)."""
    for line in table.splitlines():
        cells = [c.strip() for c in line.replace("┃", "│").split("│") if c.strip()]
        if cells and cells[0] == stage:
            return cells
    raise AssertionError(f"no {stage} row in\n{table}")


def test_the_cache_commands_show_hits_misses_and_oversize_and_clear_one_stage() -> None:
    # Decode's page for OCR is over a 4 KiB cap and never kept; OCR's text is.
    device = {"STOKER_BACKEND": "sim", "STOKER_CACHE_MAX_VALUE_BYTES": "4096"}
    with own_fleet(device, kinds=("cpu", "infer")) as crew:

        def run(*words: str) -> dict[str, Any]:
            # A job with a new image beside a known one is preprocessed (only a fully cached job skips that).
            files = [("image", (f"{w}.png", text_image(w), "image/png")) for w in words]
            response = crew.client.post("/v1/jobs", data={"prompt": "What do they say?"}, files=files)
            job = _wait(crew.client, response.json()["id"])
            assert job["status"] == "succeeded", job
            return job

        run("OPERATOR 55")
        run("OPERATOR 55", "SECOND 66")  # the first page's OCR comes from the cache, the second's is new
        table = _cli(crew.env, "cache", "stats")
        assert _row(table, "ocr")[1:4] == ["1", "2", "33%"]  # hits, misses, hit rate
        assert _row(table, "decode")[1:3] == ["1", "2"]  # its small facts are kept…
        assert int(_row(table, "decode")[6]) >= 2  # …its pictures never: each miss counted them oversize
        assert "deleted 2 cached entries" in _cli(crew.env, "cache", "clear", "--stage", "ocr")
        with redis.Redis.from_url(crew.env["STOKER_CACHE_URL"]) as cache:
            assert list(cache.scan_iter("stoker:cache:ocr:*")) == []
            assert list(cache.scan_iter("stoker:cache:tokenize:*"))  # other stages kept
        assert "ocr" not in [_row_stage(line) for line in _cli(crew.env, "cache", "stats").splitlines()]
        again = run("OPERATOR 55", "THIRD 77")
        assert again["inputs"][0]["cache_hit"]["ocr"] is False  # cleared: read again
        assert "deleted" in _cli(crew.env, "cache", "clear")
        with redis.Redis.from_url(crew.env["STOKER_CACHE_URL"]) as cache:
            assert list(cache.scan_iter("stoker:cache:*")) == []


def _row_stage(line: str) -> str:
    cells = [c.strip() for c in line.split("│") if c.strip()]
    return cells[0] if cells else ""
