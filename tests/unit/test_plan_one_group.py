"""`PlanOptions.one_group_models`: a model's layers of one kind share one block table
(vLLM 0.33's draft proposer reads every draft layer through one KV-cache group)."""

from __future__ import annotations

import pytest

from hybridkv.models import load_model_spec
from hybridkv.plan import CachePlan, PlanOptions, plan
from hybridkv.spec.dtypes import DType

SEED = dict(
    spec_method="draft",
    num_spec_tokens=3,
    kv_dtype=DType("fp8_e4m3"),
    memory_bytes=60 << 30,
    max_model_len=32768,
    layout="shared",
)


def _seed(**values: object) -> CachePlan:
    options = PlanOptions(**{**SEED, **values})  # type: ignore[arg-type]
    return plan(load_model_spec("qwen3-coder-next-80b-a3b"), load_model_spec("qwen3-4b"), options)


def _draft_groups(result: CachePlan) -> list[int]:
    return [g.group_id for g in result.groups if g.model == "draft"]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_seed_pair_keeps_the_draft_in_one_group_at_zero_padding(prefix_caching: bool) -> None:
    free = _seed(prefix_caching=prefix_caching)
    one = _seed(prefix_caching=prefix_caching, one_group_models=("draft",))
    assert len(_draft_groups(free)) > 1  # unconstrained, the best plan splits the draft
    assert len(_draft_groups(one)) == 1
    (draft,) = [g for g in one.groups if g.model == "draft"]
    assert len(draft.layers) == 36 and draft.block_size % 16 == 0
    assert one.waste_bytes == 0
    # the constraint costs well under 2% of the unconstrained plan's requests at 32K
    assert one.capacity.max_concurrency_float >= 0.98 * free.capacity.max_concurrency_float
    assert one.capacity.max_concurrency >= 21


def test_one_group_holds_for_tensor_packing_too() -> None:
    one = _seed(one_group_models=("draft",), packing="tensor")
    assert len(_draft_groups(one)) == 1
    assert all(p.packing == "tensor" for p in one.pools)


def test_main_model_kept_whole() -> None:
    """The main model's state class in one group: its slab holds all 36 state pages."""
    one = _seed(one_group_models=("main", "draft"))
    kinds = [g.kind for g in one.groups if g.model == "main"]
    assert len(kinds) == len(set(kinds))  # one group per main layer kind
