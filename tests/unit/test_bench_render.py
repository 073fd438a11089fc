"""`bench.render`'s pure parts: the requests are the same for a seed and carry what each scenario says; the summary's
arithmetic and the stoker ÷ vLLM ratios."""

from __future__ import annotations

import base64
import json
from dataclasses import replace

from bench.render import (
    SCENARIOS,
    SETTLE_MIN,
    Answer,
    Phase,
    RenderRequest,
    Settled,
    ratios,
    requests_for,
    settled_line,
    steady,
    summarise,
)

SMALL = {key: replace(s, size=(64, 48)) for key, s in SCENARIOS.items()}


def _pictures(request: RenderRequest) -> list[bytes]:
    parts = json.loads(request.body)["messages"][0]["content"]
    return [base64.b64decode(p["image_url"]["url"].split(",", 1)[1]) for p in parts if p["type"] == "image_url"]


def test_the_same_seed_and_phase_give_the_same_bodies_and_another_phase_new_pictures() -> None:
    first = requests_for(SMALL["a"], "closed", 6, 7, "tiny")
    assert [r.body for r in first] == [r.body for r in requests_for(SMALL["a"], "closed", 6, 7, "tiny")]
    other = requests_for(SMALL["a"], "open0.5", 6, 7, "tiny")
    assert not {p for r in first for p in _pictures(r)} & {p for r in other for p in _pictures(r)}


def test_four_pictures_a_request_all_distinct() -> None:
    requests = requests_for(SMALL["b"], "closed", 5, 7, "tiny")
    pictures = [p for r in requests for p in _pictures(r)]
    assert [r.pictures for r in requests] == [4] * 5
    assert len(set(pictures)) == 20 == sum(r.distinct for r in requests)


def test_repeats_are_byte_identical_earlier_pictures_counted_as_not_distinct() -> None:
    requests = requests_for(SMALL["c"], "closed", 200, 7, "tiny")
    pictures = [_pictures(r)[0] for r in requests]
    distinct = sum(r.distinct for r in requests)
    assert distinct == len(set(pictures))
    assert 0.3 < 1 - distinct / len(requests) < 0.5


def test_broken_or_oversized_pictures_are_flagged_and_not_distinct() -> None:
    requests = requests_for(SMALL["d"], "closed", 400, 7, "tiny")
    bad = [r for r in requests if r.bad]
    assert 0.02 < len(bad) / len(requests) < 0.09
    assert all(r.distinct == 0 for r in bad)
    kinds = {_pictures(r)[0][:4] for r in bad}
    assert kinds == {b"\x89PNG", b"\xff\xd8\xff\xe0"}  # a bomb and a truncated JPEG


def _phase(server: str, phase: str, rendered: int, wall_s: float, cpu_s: float, latency_s: float) -> Phase:
    answers = [Answer(200, latency_s)] * rendered + [Answer(500, 0.01, None, "boom")]
    offered = None if phase == "closed" else 1.0
    return Phase("a", server, phase, offered, wall_s, answers, rendered + 1, rendered, {"all": cpu_s}, 0.0)


def test_the_summary_divides_cpu_by_pictures_and_the_ratios_put_stoker_over_vllm() -> None:
    phases = [
        _phase(server, phase, 10, wall, cpu, latency)
        for server, wall, cpu, latency in (("vLLM", 2.0, 1.0, 0.2), ("stoker", 1.0, 0.5, 0.1))
        for phase in ("closed", "50%", "90%")
    ]
    rows = summarise(phases)
    assert [(r["server"], r["renders_per_s"], r["5xx"]) for r in rows] == [("vLLM", 5.0, 3), ("stoker", 10.0, 3)]
    assert rows[0]["cpu_s_per_picture"] == round(3.0 / 33, 4)
    assert rows[0]["cpu_s_per_distinct_picture"] == 0.1
    assert ratios(rows)["a"] == {"renders": 2.0, "p99_at_90": 0.5, "cpu": 0.5, "cpu_distinct": 0.5}


def test_a_server_is_settled_once_a_round_no_longer_grows_its_memory() -> None:
    full = [6000.0] * SETTLE_MIN
    filling = [2400.0, 3600.0, 4800.0, *full]  # a processor cache filling (1.2 GB a round), then full
    assert steady([*filling, 6100.0])  # +1.7 %: recycling what it evicts
    assert not steady([*filling, 6300.0])  # +5 %
    assert not steady([*filling[: SETTLE_MIN - 1], filling[SETTLE_MIN - 2]])  # flat, but too few rounds to say


def test_the_report_says_how_each_server_was_settled_or_that_none_was() -> None:
    line = settled_line([Settled("vLLM", 12, (1158.0, 6790.0), (180.0, 106.0))])
    assert line.endswith("vLLM 480 pictures in 12 rounds, resident 1,158 → 6,790 MB, 180 → 106 CPU ms a picture")
    assert settled_line([]).startswith("Not settled")
