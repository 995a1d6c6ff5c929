"""One formula: what the planner budgets is what the allocator really takes.

1. Peak per group and per pool: a request decoding one token at a time with ``K``
   drafts reserved every step (every ``c`` from 0 to ``T - 1`` is visited) holds, at its
   worst step, exactly ``GroupPlan.blocks_needed(T, K)`` blocks in each group and
   exactly ``peak_blocks(pool groups, T, 1, K)`` in each pool.
   Prefill chunks too: at every step of ``n`` tokens a state group holds exactly
   ``blocks_at(c, n, K)`` (``all`` mode: one transient block per boundary inside the
   chunk; ``align``: at most one).
2. Capacity = admission: ``max_concurrency`` requests stepping together to the target
   length all fit at every step; one more does not (some step fails). Requests at
   different steps can peak at different times, so more of them may fit: the report is
   exact for requests in step, and conservative otherwise.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from hybridkv.cache import NULL_BLOCK, CacheManager
from hybridkv.cache.toy import ToyGroup, toy_plan
from hybridkv.plan import PlanOptions, plan
from hybridkv.plan.peak import peak_blocks
from hybridkv.spec import AttentionSpec, GatedDeltaNetSpec, ModelSpec, SlidingWindowSpec


def _held(cm: CacheManager, req: str, group_id: int) -> int:
    return sum(1 for b in cm.block_table(req, group_id) if b != NULL_BLOCK)


@st.composite
def toy_groups(draw):
    kinds = draw(
        st.lists(
            st.sampled_from(["full", "sliding", "chunked", "mla", "state"]), min_size=1, max_size=4
        )
    )
    unit = draw(st.sampled_from([1, 2, 4]))
    groups = []
    for kind in kinds:
        block = unit * draw(st.integers(1, 4))
        if kind in ("sliding", "chunked"):
            groups.append(ToyGroup(kind, block, draw(st.integers(1, 13))))
        else:
            groups.append(ToyGroup(kind, block))
    return groups


@settings(max_examples=60, deadline=None)
@given(
    groups=toy_groups(),
    k=st.integers(0, 3),
    mode=st.sampled_from(["align", "all", "none"]),
    num_tokens=st.integers(1, 60),
)
def test_decode_peak_equals_the_formula(groups, k, mode, num_tokens):
    p = toy_plan(groups, num_spec_tokens=k, state_mode=mode, num_blocks=400)
    cm = CacheManager(p)
    cm.add_request("r", [11])  # one prompt token: the first step is c = 0, n = 1
    assert cm.lookup("r") == 0
    peak_group = [0] * len(p.groups)
    peak_pool = [0] * len(p.pools)
    next_token = 100
    for c in range(num_tokens):
        assert cm.allocate("r", 1, k) is not None
        held = [_held(cm, "r", g.group_id) for g in p.groups]
        for g in p.groups:
            peak_group[g.group_id] = max(peak_group[g.group_id], held[g.group_id])
        for pool in p.pools:
            total = sum(held[g] for g in pool.group_ids)
            peak_pool[pool.pool_id] = max(peak_pool[pool.pool_id], total)
        cm.commit("r", 0, [next_token + c])
        cm.check_invariants()
    for g in p.groups:
        assert peak_group[g.group_id] == g.blocks_needed(num_tokens, k), (g.kind, g.block_size)
    for pool in p.pools:
        members = [p.groups[i] for i in pool.group_ids]
        assert peak_pool[pool.pool_id] == peak_blocks(members, num_tokens, 1, k)


@settings(max_examples=60, deadline=None)
@given(
    interval=st.sampled_from([4, 8]),
    k=st.integers(0, 3),
    mode=st.sampled_from(["align", "all", "none"]),
    chunks=st.lists(st.integers(1, 30), min_size=1, max_size=6),
)
def test_state_blocks_held_at_each_chunk_equal_the_formula(interval, k, mode, chunks):
    """A prompt prefilled in chunks of any size with ``k`` drafts reserved every step:
    each state group holds exactly ``blocks_at(c, n, k)`` blocks while the step is in
    flight (every checkpoint of the chunk included)."""
    groups = [ToyGroup("full", 4), ToyGroup("state", interval)]
    p = toy_plan(groups, num_spec_tokens=k, state_mode=mode, num_blocks=400)
    cm = CacheManager(p)
    prompt = list(range(1, sum(chunks) + 1))
    cm.add_request("r", prompt)
    assert cm.lookup("r") == 0
    c = 0
    for i, n in enumerate(chunks):
        assert cm.allocate("r", n, k) is not None
        for g in p.groups:
            if g.is_state:
                assert _held(cm, "r", g.group_id) == g.blocks_at(c, n, k), (c, n)
        cm.commit("r", 0, [] if i + 1 < len(chunks) else [7])
        cm.check_invariants()
        c += n


@settings(max_examples=80, deadline=None)
@given(
    interval=st.sampled_from([4, 8, 12]),
    k=st.integers(0, 3),
    mode=st.sampled_from(["align", "all"]),
    rules=st.sampled_from([("junction",), ("junction", "turn_end")]),
    shared=st.integers(5, 40),
    first=st.integers(0, 12),
    chunks=st.lists(st.integers(1, 30), min_size=1, max_size=5),
)
def test_junction_steps_hold_exactly_the_formula(interval, k, mode, rules, shared, first, chunks):
    """A request that starts from a hit and prefills across its junction checkpoint (the
    transient block of the junction rule, at a boundary or, with turn_end, inside an
    interval): each state group holds exactly ``blocks_at(c, n, k, junction)``."""
    groups = [ToyGroup("full", 4), ToyGroup("state", interval)]
    p = toy_plan(groups, num_spec_tokens=k, state_mode=mode, num_blocks=400)
    cm = CacheManager(p, checkpoint_rules=rules)
    a = list(range(1, shared + first + 2))
    cm.add_request("a", a)
    cm.lookup("a")
    if first:  # a first chunk that leaves an earlier checkpoint than the shared end
        cm.allocate("a", first)
        cm.commit("a", 0, [])
    cm.allocate("a", len(a) - first)
    cm.commit("a", 0, [999])
    cm.free("a")
    b = a[:shared] + [5000 + i for i in range(sum(chunks))]
    cm.add_request("b", b)
    c = hit = cm.lookup("b")
    crossed = 0
    junctions: dict[int, int] = {}  # group -> the junction set at admission
    for n in chunks:
        n = min(n, len(b) - c)
        if n <= 0:
            break
        assert cm.allocate("b", n, k) is not None
        record = cm._requests["b"]
        for g in p.groups:
            if g.is_state:
                junction = junctions.setdefault(g.group_id, record.states[g.group_id].junction)
                crossed += c < junction < c + n
                # a cached state: a hit, a boundary, or a junction the last chunk ended on
                # (with turn_end inside any interval, the first one too: a root anchor)
                cached = (c == hit > 0) or (c > 0 and c % interval == 0) or (c == junction > 0)
                expected = g.blocks_at(c, n, k, junction, cached)
                assert _held(cm, "b", g.group_id) == expected, (c, n, junction, cached)
        cm.commit("b", 0, [] if c + n < len(b) else [7])
        cm.check_invariants()
        c += n
    event("junction crossed" if crossed else "no junction crossed")


ATTN = AttentionSpec(num_kv_heads=2, head_dim=64)
SWA = SlidingWindowSpec(num_kv_heads=2, head_dim=64, sliding_window=40)
GDN = GatedDeltaNetSpec(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32, conv_kernel=4)
MAIN = ModelSpec(
    name="toy-hybrid-swa",
    model_type="toy",
    layers=(GDN, SWA, GDN, ATTN) * 2,
    max_position_embeddings=4096,
)
DRAFT = ModelSpec(
    name="toy-draft", model_type="toy", layers=(ATTN,) * 2, max_position_embeddings=4096
)


@settings(max_examples=12, deadline=None)
@given(
    layout=st.sampled_from(["shared", "split", "vllm"]),
    mode=st.sampled_from(["align", "all", "none"]),
    k=st.integers(0, 3),
    target=st.integers(40, 200),
    draft=st.booleans(),
    memory_mib=st.integers(3, 12),
)
def test_capacity_equals_what_the_allocator_admits_in_step(
    layout, mode, k, target, draft, memory_mib
):
    options = PlanOptions(
        layout=layout,
        memory_bytes=memory_mib << 20,
        max_model_len=1024,
        target_len=target,
        spec_method="draft" if draft else ("ngram" if k else None),
        num_spec_tokens=k,
        state_mode=mode,
        max_num_seqs=64,
    )
    try:
        p = plan(MAIN, DRAFT if draft else None, options)
    except Exception as err:
        assert type(err).__name__ == "PlanError"
        return
    n_max = p.capacity.max_concurrency
    if not 0 < n_max <= 40:
        return
    assert _all_fit_in_step(p, n_max, target, k)
    assert not _all_fit_in_step(p, n_max + 1, target, k)


def _all_fit_in_step(p, num_requests: int, target: int, k: int) -> bool:
    cm = CacheManager(p)
    reqs = [f"r{i}" for i in range(num_requests)]
    for i, req in enumerate(reqs):
        cm.add_request(req, [1000 * i + 1])  # distinct: no prefix hits
        cm.lookup(req)
    for c in range(target):
        for req in reqs:
            if cm.allocate(req, 1, k) is None:
                return False
        for i, req in enumerate(reqs):
            cm.commit(req, 0, [1000 * i + 2 + c])
    cm.check_invariants()
    return True


def test_pool_peak_is_exact_when_the_joint_period_outlasts_the_request():
    """Chunked groups whose joint period (lcm 1320 tokens) is longer than the request:
    the pool's peak is the scanned per-step sum (11 blocks at c = 12), not the sum of
    each group's own peak (12). Found by Hypothesis."""
    groups = [
        ToyGroup("full", 4, 0, "main"),
        ToyGroup("chunked", 8, 5, "main"),
        ToyGroup("chunked", 4, 13, "main"),
        ToyGroup("chunked", 12, 11, "main"),
    ]
    p = toy_plan(groups, num_spec_tokens=0, state_mode="align", num_blocks=400)
    assert peak_blocks(p.groups, 13, 1, 0) == 11
