"""Trace format (DESIGN section 10): good lines round-trip; every bad line names its line."""

from __future__ import annotations

import json

import pytest

from hybridkv.errors import TraceError
from hybridkv.sim.trace import TraceRequest, parse_trace, read_trace, write_trace

GOOD = {"id": "a", "arrival_s": 0.5, "prompt": [1, 2, 3], "output": [4, 5, 6, 7]}


def _lines(bad: str) -> list[str]:
    """Two good lines, a blank line, then the bad one: the bad line is line 4."""
    first = json.dumps(GOOD)
    second = json.dumps({**GOOD, "id": "b", "spec": [[2, 1], [3, 0]], "cache_salt": "s"})
    return [first, second, "   ", bad]


def test_good_lines_parse_with_optional_fields() -> None:
    requests = parse_trace(_lines(json.dumps({**GOOD, "id": "c", "arrival_s": 2})))
    assert [r.id for r in requests] == ["a", "b", "c"]
    assert requests[0].spec is None and requests[0].cache_salt is None
    assert requests[1].spec == ((2, 1), (3, 0)) and requests[1].cache_salt == "s"
    assert requests[2].arrival_s == 2.0 and requests[2].prompt == (1, 2, 3)


def test_write_then_read_round_trips(tmp_path) -> None:
    requests = [
        TraceRequest(id="x", arrival_s=0.0, prompt=(1,), output=(2, 3), spec=((1, 1),)),
        TraceRequest(id="y", arrival_s=1.25, prompt=(7, 8), output=(9,), cache_salt="t"),
    ]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, requests) == 2
    assert read_trace(path) == requests


def test_last_step_may_overshoot_and_steps_may_run_short() -> None:
    over = {**GOOD, "spec": [[5, 5]]}  # emits 6 tokens where 3 remain: allowed
    short = {**GOOD, "id": "s", "spec": [[1, 0]]}  # 1 of 3 remaining: the rest propose 0
    assert len(parse_trace([json.dumps(over), json.dumps(short)])) == 2


BAD_LINES = {
    "invalid json": '{"id": "z", ',
    "not an object": "[1, 2, 3]",
    "unknown key": json.dumps({**GOOD, "id": "z", "temperature": 0.7}),
    "missing key": json.dumps({"id": "z", "arrival_s": 0.0, "prompt": [1]}),
    "id not a string": json.dumps({**GOOD, "id": 7}),
    "empty id": json.dumps({**GOOD, "id": ""}),
    "negative arrival": json.dumps({**GOOD, "id": "z", "arrival_s": -1}),
    "bool arrival": json.dumps({**GOOD, "id": "z", "arrival_s": True}),
    "nan arrival": '{"id": "z", "arrival_s": NaN, "prompt": [1], "output": [2]}',
    "empty prompt": json.dumps({**GOOD, "id": "z", "prompt": []}),
    "prompt not a list": json.dumps({**GOOD, "id": "z", "prompt": "hello"}),
    "negative token": json.dumps({**GOOD, "id": "z", "prompt": [1, -2]}),
    "float token": json.dumps({**GOOD, "id": "z", "output": [1.5]}),
    "bool token": json.dumps({**GOOD, "id": "z", "output": [True]}),
    "empty output": json.dumps({**GOOD, "id": "z", "output": []}),
    "spec not a list": json.dumps({**GOOD, "id": "z", "spec": 3}),
    "spec step not a pair": json.dumps({**GOOD, "id": "z", "spec": [[1, 0, 0]]}),
    "spec accepted > proposed": json.dumps({**GOOD, "id": "z", "spec": [[1, 2]]}),
    "spec negative": json.dumps({**GOOD, "id": "z", "spec": [[-1, 0]]}),
    "spec too many steps": json.dumps({**GOOD, "id": "z", "spec": [[2, 2], [0, 0]]}),
    "salt not a string": json.dumps({**GOOD, "id": "z", "cache_salt": 5}),
    "duplicate id": json.dumps(GOOD),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_names_its_line_number(case: str) -> None:
    with pytest.raises(TraceError, match=r"^line 4: "):
        parse_trace(_lines(BAD_LINES[case]))


def test_unknown_key_message_lists_the_key() -> None:
    with pytest.raises(TraceError, match="'temperature'"):
        parse_trace(_lines(BAD_LINES["unknown key"]))


def test_duplicate_id_names_the_first_line() -> None:
    with pytest.raises(TraceError, match="first on line 1"):
        parse_trace(_lines(BAD_LINES["duplicate id"]))
