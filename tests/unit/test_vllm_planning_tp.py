"""The vLLM plugin's block-size planning per tensor-parallel shard, without vLLM.

Under tensor parallelism vLLM's rule runs in every worker on that worker's shard: the
tiny Qwen3-Next's 2 KV heads and 4 / 8 Gated DeltaNet key / value heads are divided
over the ranks (KV heads fewer than ranks are replicated, one per rank). The facts
below are what vLLM's formulas give per shard (bf16 KV and conv state, fp32 ssm state,
head size 64, 3 conv rows)::

    TP  attention B/token        state page (conv + ssm)                    vLLM's block
    1   2 x 128 x 2 = 512        (2*4*64 + 8*64) * 3 * 2 + 8*64*64*4 = 137,216   384
    2   1 x 128 x 2 = 256        (2*2*64 + 4*64) * 3 * 2 + 4*64*64*4 =  68,608   384
    4   1 x 128 x 2 = 256 (rep.) (2*1*64 + 2*64) * 3 * 2 + 2*64*64*4 =  34,304   256

hybridkv must plan the same shard (`VllmFacts.tp`); planning the whole model against
a shard's pages is refused (the specs disagree), which is what TP 2 did before.
"""

from __future__ import annotations

import dataclasses

import pytest
from tests.unit.test_vllm_planning import FACTS

from hybridkv import PlanError
from hybridkv.vllm.planning import VllmFacts, choose_block_size


def _shard(tp: int, state_page_bytes: int, attn_bytes_per_token: int, vllm_block: int) -> VllmFacts:
    return dataclasses.replace(
        FACTS,
        tp=tp,
        state_page_bytes=state_page_bytes,
        attn_bytes_per_token=attn_bytes_per_token,
        vllm_block_size=vllm_block,
    )


SHARDS = {
    1: _shard(1, 137216, 512, 384),
    2: _shard(2, 68608, 256, 384),
    4: _shard(4, 34304, 256, 256),
}


@pytest.mark.parametrize(
    ("tp", "block_tokens", "state_padding_pct", "requests_per_gib"),
    [(1, 256, 43.28, 279.36), (2, 256, 43.28, 558.86), (4, 128, 91.04, 711.32)],
)
def test_each_shard_keeps_state_pages_exact(
    tp: int, block_tokens: int, state_padding_pct: float, requests_per_gib: float
) -> None:
    """Every shard: the state page unpadded (vLLM's rule pads it 43-91%), the attention
    page padded 4.69% up to it, the page one shard's state page."""
    facts = SHARDS[tp]
    choice = choose_block_size(facts)
    assert choice.block_size == block_tokens
    assert choice.page_bytes == facts.state_page_bytes
    assert choice.state_page_padded is None
    assert choice.state_padding == 0.0
    assert choice.attention_page_bytes == block_tokens * facts.attn_bytes_per_token
    assert choice.attention_padding == pytest.approx(0.0469, abs=5e-5)
    assert round(100 * choice.vllm_state_padding, 2) == state_padding_pct
    assert choice.requests_per_gib == pytest.approx(requests_per_gib, abs=0.01)
    assert choice.requests_per_gib > choice.vllm_requests_per_gib
    # hybridkv's emulation of vLLM's rule lands on vLLM's block for the same shard
    assert {g.block_size for g in choice.theirs.groups} == {facts.vllm_block_size}
    assert choice.ours.options.tp == tp


def test_log_line_names_the_shard() -> None:
    assert "tensor-parallel" not in choose_block_size(SHARDS[1]).log_line(2048)
    line = choose_block_size(SHARDS[2]).log_line(2048)
    assert "each of 2 tensor-parallel shards" in line
    assert "attention block 256 tokens (vLLM's rule: 384), page 68608 B" in line


def test_plan_is_deterministic_across_ranks() -> None:
    """Every rank builds the same facts, so every rank gets the same choice (the engine
    core merges the ranks' specs and asserts they are equal per layer)."""
    first, second = choose_block_size(SHARDS[2]), choose_block_size(SHARDS[2])
    assert first.log_line(2048) == second.log_line(2048)
    assert (first.block_size, first.page_bytes, first.state_page_padded) == (
        second.block_size,
        second.page_bytes,
        second.state_page_padded,
    )


def test_whole_model_against_a_shard_is_refused() -> None:
    """The bug this guards: TP 2's shard planned as if unsharded keeps vLLM's rule."""
    unsharded = dataclasses.replace(SHARDS[2], tp=1)
    with pytest.raises(PlanError, match=r"137216 bytes, vLLM's is 68608 \(tensor-parallel size 1"):
        choose_block_size(unsharded)


def test_tp_that_does_not_divide_the_heads_is_refused() -> None:
    """TP 8 cannot split 4 Gated DeltaNet key heads (vLLM cannot shard them either)."""
    with pytest.raises(PlanError, match="num_k_heads=4 is not divisible by tensor parallel size 8"):
        choose_block_size(_shard(8, 17152, 256, 128))
