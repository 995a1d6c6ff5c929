"""Simulator traces: one request per JSONL line (DESIGN section 10).

A line is a JSON object with exactly these keys::

    {"id": "r7", "arrival_s": 0.25, "prompt": [1, 2, 3], "output": [9, 8, 7, 6],
     "spec": [[4, 2], [0, 0]], "cache_salt": "tenant-a"}

``spec`` (optional) lists one ``[num_proposed, num_accepted]`` pair per decode step;
a step emits ``num_accepted + 1`` tokens (accepted drafts plus the bonus token). The
first output token comes from the prefill, so the steps cover ``output[1:]``::

    output:  o0 | o1 o2 o3 | o4
             ^    ^          ^
         prefill  step 0     step 1
                  [4, 2]     [0, 0]     (3 tokens, then 1 token)

The last step may emit more tokens than remain (the request stops at its last output
token), so ``sum(acc + 1) >= len(output) - 1`` is allowed as long as no step starts
after the output is complete. Fewer steps than needed is fine too: the remaining
steps propose nothing. Unknown keys, wrong types, duplicate ids and impossible numbers
raise `TraceError` naming the 1-based line number; blank lines are skipped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.errors import TraceError

REQUIRED_KEYS = ("id", "arrival_s", "prompt", "output")
OPTIONAL_KEYS = ("spec", "cache_salt")
ALLOWED_KEYS = frozenset(REQUIRED_KEYS + OPTIONAL_KEYS)

SpecStep = tuple[int, int]  # (num_proposed, num_accepted)

# Token ids are hashed as fixed-width integers; real vocabularies are far below 2^31.
MAX_TOKEN_ID = (1 << 31) - 1
# About 31 years: later arrivals are typos (or a clock in ns), and floats lose the step.
MAX_ARRIVAL_S = 1e9
MAX_SPEC_DRAFTS = 1 << 16  # num_proposed per step: no proposer drafts more


@dataclass(frozen=True, kw_only=True)
class TraceRequest:
    """One request of a trace: its prompt, the tokens it will emit, and its drafts."""

    id: str
    arrival_s: float
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    spec: tuple[SpecStep, ...] | None = None
    cache_salt: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output)

    def to_json(self) -> dict[str, Any]:
        line: dict[str, Any] = {
            "id": self.id,
            "arrival_s": self.arrival_s,
            "prompt": list(self.prompt),
            "output": list(self.output),
        }
        if self.spec is not None:
            line["spec"] = [list(step) for step in self.spec]
        if self.cache_salt is not None:
            line["cache_salt"] = self.cache_salt
        return line


def _short(value: object, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters (a 4000-digit id must not flood a log)."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 4000 else "<huge>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_list(value: object, key: str, line_no: int, *, min_len: int) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TraceError(
            f"line {line_no}: {key!r} must be a list of token ids, got {type(value).__name__}"
        )
    if len(value) < min_len:
        raise TraceError(f"line {line_no}: {key!r} has {len(value)} tokens; needs >= {min_len}")
    for pos, token in enumerate(value):
        if not _is_int(token) or not 0 <= token <= MAX_TOKEN_ID:
            raise TraceError(
                f"line {line_no}: {key}[{pos}]={_short(token)} is not a token id (an int "
                f"from 0 to {MAX_TOKEN_ID})"
            )
    return tuple(value)


def _spec_steps(value: object, num_output: int, line_no: int) -> tuple[SpecStep, ...]:
    if not isinstance(value, list):
        raise TraceError(
            f"line {line_no}: 'spec' must be a list of [num_proposed, "
            f"num_accepted] pairs, got {type(value).__name__}"
        )
    steps: list[SpecStep] = []
    emitted = 1  # the prefill emits output[0]
    for pos, step in enumerate(value):
        if not isinstance(step, list) or len(step) != 2 or not all(_is_int(n) for n in step):
            raise TraceError(
                f"line {line_no}: spec[{pos}]={_short(step)} is not a "
                "[num_proposed, num_accepted] pair of ints"
            )
        proposed, accepted = step
        if proposed > MAX_SPEC_DRAFTS:
            raise TraceError(
                f"line {line_no}: spec[{pos}] proposes {_short(proposed)} drafts; at most "
                f"{MAX_SPEC_DRAFTS} per step"
            )
        if proposed < 0 or not 0 <= accepted <= proposed:
            raise TraceError(
                f"line {line_no}: spec[{pos}]=[{proposed}, {accepted}] needs "
                "0 <= num_accepted <= num_proposed"
            )
        if emitted >= num_output:
            raise TraceError(
                f"line {line_no}: spec[{pos}] starts after all {num_output} "
                f"output tokens are emitted ({len(value)} steps given)"
            )
        emitted += accepted + 1
        steps.append((proposed, accepted))
    return tuple(steps)


def parse_trace_line(text: str, line_no: int) -> TraceRequest:
    """Parse one non-blank JSONL line; ``line_no`` (1-based) goes into every error."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise TraceError(
            f"line {line_no}: not valid JSON ({err.msg} at column {err.colno})"
        ) from None
    except (ValueError, RecursionError) as err:  # e.g. an int of more than 4300 digits
        raise TraceError(f"line {line_no}: not valid JSON for a trace ({err})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"line {line_no}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - ALLOWED_KEYS)
    if unknown:
        raise TraceError(
            f"line {line_no}: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(REQUIRED_KEYS + OPTIONAL_KEYS)}"
        )
    missing = [key for key in REQUIRED_KEYS if key not in obj]
    if missing:
        raise TraceError(f"line {line_no}: missing key(s) {', '.join(map(repr, missing))}")
    req_id = obj["id"]
    if not isinstance(req_id, str) or not req_id:
        raise TraceError(f"line {line_no}: 'id' must be a non-empty string, got {_short(req_id)}")
    arrival = obj["arrival_s"]
    if (
        not isinstance(arrival, int | float)
        or isinstance(arrival, bool)
        or not 0 <= arrival <= MAX_ARRIVAL_S
        or not math.isfinite(arrival)
    ):
        raise TraceError(
            f"line {line_no}: 'arrival_s'={_short(arrival)} must be a number of seconds from 0 "
            f"to {MAX_ARRIVAL_S:.0e}"
        )
    prompt = _token_list(obj["prompt"], "prompt", line_no, min_len=1)
    output = _token_list(obj["output"], "output", line_no, min_len=1)
    spec = _spec_steps(obj["spec"], len(output), line_no) if obj.get("spec") is not None else None
    salt = obj.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise TraceError(f"line {line_no}: 'cache_salt' must be a string, got {_short(salt)}")
    return TraceRequest(
        id=req_id,
        arrival_s=float(arrival),
        prompt=prompt,
        output=output,
        spec=spec,
        cache_salt=salt,
    )


def parse_trace(lines: Iterable[str]) -> list[TraceRequest]:
    """Parse JSONL text lines into requests (file order); ids must be unique."""
    requests: list[TraceRequest] = []
    first_line: dict[str, int] = {}
    for line_no, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        request = parse_trace_line(text, line_no)
        if request.id in first_line:
            raise TraceError(
                f"line {line_no}: duplicate id {request.id!r} (first on line "
                f"{first_line[request.id]})"
            )
        first_line[request.id] = line_no
        requests.append(request)
    return requests


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSONL trace file; raises `TraceError` (with the line) or `OSError`."""
    try:
        with open(path, encoding="utf-8") as handle:
            return parse_trace(handle)
    except UnicodeDecodeError as err:
        raise TraceError(
            f"trace {path} is not UTF-8 text (byte {err.start}): {err.reason}"
        ) from None


def iter_trace_lines(requests: Iterable[TraceRequest]) -> Iterator[str]:
    for request in requests:
        yield json.dumps(request.to_json(), separators=(",", ":"))


def write_trace(path: str | Path, requests: Sequence[TraceRequest]) -> int:
    """Write requests as JSONL; returns the number of lines written."""
    count = 0
    with open(path, "w", encoding="utf-8") as handle:
        for line in iter_trace_lines(requests):
            handle.write(line + "\n")
            count += 1
    return count
