"""Every state checkpoint policy restores states that give transformers' tokens exactly.

Multi-turn sessions on tiny hybrid checkpoints (Gated DeltaNet, Mamba2): turn t + 1's
prompt is turn t's prompt, its output and a new message. Under ``state_mode="all"`` a
checkpoint exists at every block boundary, so each turn resumes from the previous
turn's whole context to within one hit-granularity step; ``align`` + ``junction``
checkpoints where a prompt leaves a cached prefix. Tokens must equal transformers'
greedy tokens for the same prompts, with and without n-gram speculation."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import hf_greedy  # noqa: E402
from llm_support import BUILDERS, VOCAB  # noqa: E402
from test_mtp_head import K, check_against_reference, mtp_case, record_drafts  # noqa: E402, F401

from hybridkv.engine import LLM  # noqa: E402

NUM_NEW = 12
NUM_TURNS = 3


def _sessions(seed: int = 11) -> list[list[list[int]]]:
    """Two sessions of user messages (a shared 30-token system prompt opens both)."""
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    system = draw(30)
    return [[system + draw(9), draw(7), draw(11)], [system + draw(4), draw(13), draw(5)]]


def _first_block_sessions(seed: int = 13) -> list[list[list[int]]]:
    """Two sessions whose first turns (a shared 2-token system prompt, a 1- or 2-token
    message and `NUM_NEW` output tokens: 15 and 16 tokens) end inside the first block
    (16 or 32 tokens in the tiny hybrids): turn 2 resumes from turn-end entries anchored
    at the chain's root."""
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    system = draw(2)
    return [[system + draw(1), draw(5), draw(11)], [system + draw(2), draw(2), draw(9)]]


def _hf(name: str, folder):
    model_cls, _ = BUILDERS[name]()
    return model_cls.from_pretrained(folder, torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("spec", [None, "ngram"])
@pytest.mark.parametrize(
    ("state_mode", "rules"), [("all", ()), ("align", ("junction",)), ("none", ())]
)
@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_multi_turn_sessions_are_token_exact_under_every_policy(
    llm_case, name, state_mode, rules, spec
):
    case = llm_case(name)
    hf = _hf(name, case.folder)
    llm = LLM(
        case.folder,
        chunk_size=16,
        state_mode=state_mode,
        checkpoint_rules=rules,
        spec_method=spec,
        num_spec_tokens=3 if spec else 0,
    )
    granularity = llm.plan.hit_granularity_tokens
    contexts = [list(messages[0]) for messages in _sessions()]
    previous = [0, 0]
    for turn in range(NUM_TURNS):
        if turn:
            for s, messages in enumerate(_sessions()):
                contexts[s] += messages[turn]
        results = llm.generate([list(c) for c in contexts], NUM_NEW)
        assert [r.token_ids for r in results] == hf_greedy(hf, contexts, NUM_NEW)
        for s, r in enumerate(results):
            hit = r.stats.prefix_hit_tokens
            if state_mode == "all" and turn:
                # the previous turn's context (its last sampled token never computed)
                assert hit > previous[s] - 1 - granularity, (turn, s, hit, previous[s])
            if state_mode == "none":
                assert hit == 0
            contexts[s] += r.token_ids
            previous[s] = len(contexts[s])
    llm.manager.check_invariants()


@pytest.mark.parametrize("sessions", [_sessions, _first_block_sessions], ids=["long", "short"])
@pytest.mark.parametrize("spec", [None, "ngram"])
@pytest.mark.parametrize(
    ("state_mode", "rules"), [("all", ("turn_end",)), ("align", ("junction", "turn_end"))]
)
@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_turn_end_resumes_each_turn_at_the_previous_last_token(
    llm_case, name, state_mode, rules, spec, sessions
):
    """With the ``turn_end`` rule each turn hits the previous turn's whole context but
    its last sampled token (never computed): the partial last block and the state
    after exactly that many tokens are restored, and the tokens are transformers'.
    Short sessions: the first turns end inside the first block (a root anchor)."""
    case = llm_case(name)
    hf = _hf(name, case.folder)
    llm = LLM(
        case.folder,
        chunk_size=16,
        state_mode=state_mode,
        checkpoint_rules=rules,
        spec_method=spec,
        num_spec_tokens=3 if spec else 0,
    )
    granularity = llm.plan.hit_granularity_tokens
    contexts = [list(messages[0]) for messages in sessions()]
    previous = [0, 0]
    off_boundary = first_block = 0
    for turn in range(NUM_TURNS):
        if turn:
            for s, messages in enumerate(sessions()):
                contexts[s] += messages[turn]
        results = llm.generate([list(c) for c in contexts], NUM_NEW)
        assert [r.token_ids for r in results] == hf_greedy(hf, contexts, NUM_NEW)
        for s, r in enumerate(results):
            hit = r.stats.prefix_hit_tokens
            if turn:
                assert hit == previous[s] - 1, (turn, s, hit, previous[s])
                off_boundary += hit % granularity != 0
                first_block += 0 < hit < granularity
            contexts[s] += r.token_ids
            previous[s] = len(contexts[s])
        llm.manager.check_invariants()
    assert off_boundary  # some hits resumed inside a block (else this tests nothing new)
    assert (first_block >= 2) == (sessions is _first_block_sessions)  # each session's turn 2


@pytest.mark.parametrize("sessions", [_sessions, _first_block_sessions], ids=["long", "short"])
def test_turn_end_under_mtp_reuses_the_heads_kv_in_the_partial_block(
    mtp_case,  # noqa: F811
    sessions,
):
    """MTP: the head's attention group keys its turn-end entry one token ahead; each turn
    still resumes at the previous turn's last computed token, the drafts equal the
    reference head's and the tokens transformers'."""
    folder, hf, ref = mtp_case("qwen3_next", True)
    llm = LLM(
        folder,
        spec_method="mtp",
        num_spec_tokens=K,
        chunk_size=16,
        state_mode="align",
        checkpoint_rules=("junction", "turn_end"),
    )
    granularity = llm.plan.hit_granularity_tokens
    seen = record_drafts(llm)
    contexts = [list(messages[0]) for messages in sessions()]
    previous = [0, 0]
    off_boundary = 0
    for turn in range(NUM_TURNS):
        if turn:
            for s, messages in enumerate(sessions()):
                contexts[s] += messages[turn]
        results = llm.generate([list(c) for c in contexts], NUM_NEW)
        assert [r.token_ids for r in results] == hf_greedy(hf, contexts, NUM_NEW)
        for s, r in enumerate(results):
            if turn:
                assert r.stats.prefix_hit_tokens == previous[s] - 1, (turn, s, previous[s])
                off_boundary += r.stats.prefix_hit_tokens % granularity != 0
            contexts[s] += r.token_ids
            previous[s] = len(contexts[s])
    check_against_reference(ref, seen)
    assert off_boundary
    llm.manager.check_invariants()
