"""vLLM's facts in, hybridkv's block size and page padding out (no vLLM import here).

vLLM's rule for a hybrid model (attention + Mamba / Gated DeltaNet layers), as its
platform code states it (0.32 / 0.33 ``Platform._align_hybrid_block_size``): the
attention block is the smallest multiple of ``align`` tokens whose page holds the largest
state page, where ``align`` is the larger of the attention kernel's block unit and the
configured block size (128 on vLLM's CPU platform); every state page is then padded up to
that attention page. On a small model that can pad the state pages by tens of percent
and inflate attention blocks to hundreds of tokens.

hybridkv plans the same layers with its ``shared`` layout restricted to what vLLM's
workers accept (one page size for every tensor, ``tensor`` packing, blocks a multiple of
the kernel's own unit): it may pad the *attention* page instead (vLLM reads a padded
attention page through a strided view, `unify_kv_cache_spec_page_size`), and picks the
block by capacity at ``max_model_len``. Worked example, the tiny Qwen3-Next of the tests
(2 attention layers, 512 bytes per token and layer; Gated DeltaNet state 137,216 bytes;
CPU kernel unit 32, vLLM's align 128)::

    vLLM:     block 384  page 196,608   state padded 43.28%
    hybridkv: block 256  page 137,216   state exact, attention page 131,072 padded 4.69%

Both plans are hybridkv's own arithmetic (`hybridkv.plan`); the caller checks that
hybridkv's page sizes equal vLLM's before it applies anything, and keeps vLLM's rule
with the reason otherwise.

With tensor parallelism each worker holds one shard of every layer (attention KV heads
and Gated DeltaNet / Mamba heads divided over the ranks), and vLLM's rule runs on that
shard in every worker. hybridkv plans the same shard (``PlanOptions.tp``): at TP 2 the
tiny model's state page is 68,608 bytes and its attention layers keep 256 bytes per
token. The plan depends only on facts every rank shares, so all ranks choose the same
block size and the engine core, which merges the ranks' specs, sees one layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import HybridKVError, PlanError
from hybridkv.plan import CachePlan, PlanOptions, plan
from hybridkv.spec.dtypes import DType

NOMINAL_KV_BYTES = 1 << 30  # capacity is compared per GiB: vLLM sizes its pool later
# vLLM's speculative methods -> hybridkv's (what the planner needs: draft states kept)
SPEC_METHODS = {
    "ngram": "ngram",
    "ngram_gpu": "ngram",
    "custom_class": "ngram",  # a user's drafter; like n-gram, it keeps no KV cache
    "suffix": "suffix",
    "eagle": "eagle",
    "eagle3": "eagle",
    "mtp": "mtp",
}


@dataclass(frozen=True, kw_only=True)
class VllmFacts:
    """What vLLM resolved for one engine, in plain numbers and names."""

    hf_config: Mapping[str, Any]
    max_model_len: int
    kv_dtype: str  # hybridkv dtype names: bfloat16, float16, float32, fp8_e4m3, fp8_e5m2
    conv_dtype: str
    ssm_dtype: str
    attn_bytes_per_token: int  # one attention layer, one token (vLLM's own page / block)
    state_page_bytes: int  # vLLM's unpadded Mamba page
    kernel_align_tokens: int  # the attention kernel's block unit (CPU: 32)
    vllm_block_size: int  # what vLLM's rule chose
    vllm_align_tokens: int  # the unit vLLM's rule rounded to
    state_mode: str  # vLLM's mamba_cache_mode: none | align | all
    prefix_caching: bool
    spec_method: str | None = None  # vLLM's method name
    num_spec_tokens: int = 0
    user_block_size: int | None = None
    # vLLM's tensor-parallel size: the page numbers above are one rank's shard (heads
    # divided over ranks), so hybridkv plans the same shard; every rank has the same
    # facts, hence the same plan, and the engine core merges equal specs
    tp: int = 1
    # a separate draft model's config (vLLM's ``draft_model`` method): its layers share
    # the block size chosen here, so hybridkv plans main + draft together
    draft_hf_config: Mapping[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class VllmChoice:
    """hybridkv's answer, ready to write into vLLM's cache config."""

    block_size: int
    page_bytes: int
    state_page_padded: int | None  # vLLM's mamba_page_size_padded (None: exact)
    attention_page_bytes: int  # raw; vLLM pads it to page_bytes when smaller
    state_padding: float  # fraction of the state page
    attention_padding: float  # fraction of the attention page
    vllm_block_size: int
    vllm_state_padding: float
    requests_per_gib: float  # at max_model_len, hybridkv's capacity arithmetic
    vllm_requests_per_gib: float
    ours: CachePlan
    theirs: CachePlan

    def log_line(self, max_model_len: int) -> str:
        ratio = self.requests_per_gib / self.vllm_requests_per_gib
        tp = self.ours.options.tp
        shard = f", each of {tp} tensor-parallel shards" if tp > 1 else ""
        return (
            f"hybridkv plan (layout {self.ours.layout}, tensor pages{shard}): attention block "
            f"{self.block_size} tokens (vLLM's rule: {self.vllm_block_size}), page "
            f"{self.page_bytes} B; padding: state {100 * self.state_padding:.2f}%, attention "
            f"{100 * self.attention_padding:.2f}% (vLLM's rule: state "
            f"{100 * self.vllm_state_padding:.2f}%); requests at {max_model_len} tokens per "
            f"GiB of KV cache: {self.requests_per_gib:.2f} (vLLM's rule: "
            f"{self.vllm_requests_per_gib:.2f}, {ratio:.2f}x)"
        )


def _dtype(name: str, what: str) -> DType:
    try:
        return DType(name)
    except ValueError as err:
        raise PlanError(f"{what} dtype {name!r} has no hybridkv equivalent") from err


def _options(facts: VllmFacts, **values: Any) -> PlanOptions:
    if facts.spec_method == "draft_model" and facts.draft_hf_config is None:
        raise PlanError("the draft model's config is not known; hybridkv plans main + draft")
    method = (
        "draft"
        if facts.spec_method == "draft_model"
        else SPEC_METHODS.get(facts.spec_method)
        if facts.spec_method
        else None
    )
    if facts.spec_method and method is None:
        raise PlanError(f"speculative method {facts.spec_method!r} is not mapped to hybridkv's")
    return PlanOptions(
        spec_method=method,
        num_spec_tokens=facts.num_spec_tokens if method else 0,
        kv_dtype=_dtype(facts.kv_dtype, "KV cache"),
        conv_dtype=_dtype(facts.conv_dtype, "conv state"),
        ssm_dtype=_dtype(facts.ssm_dtype, "ssm state"),
        max_model_len=facts.max_model_len,
        prefix_caching=facts.prefix_caching,
        state_mode=facts.state_mode if facts.prefix_caching else "none",
        memory_bytes=NOMINAL_KV_BYTES,
        packing="tensor",
        tp=facts.tp,
        # vLLM's draft proposer reads every draft layer through one KV-cache group (its
        # own grouping, modelled by layout "vllm", may split the draft all the same)
        one_group_models=("draft",) if method == "draft" and values["layout"] != "vllm" else (),
        **values,
    )


def _check_same_pages(ours: CachePlan, facts: VllmFacts) -> None:
    """hybridkv's per-layer arithmetic must equal vLLM's before its plan means anything."""
    for group in ours.groups:
        layers = ", ".join(ref.name for ref in group.layers)
        if group.model == "draft":
            continue  # vLLM's draft specs are compared where they are grouped (`grouping`)
        if group.is_state:
            if group.page_bytes != facts.state_page_bytes:
                raise PlanError(
                    f"hybridkv's state page for layers {layers} is {group.page_bytes} bytes, "
                    f"vLLM's is {facts.state_page_bytes} (tensor-parallel size {facts.tp}); the "
                    "specs disagree (dtypes, speculative rows or shards), so vLLM's rule is kept"
                )
        else:
            per_token = group.page_bytes // group.block_size
            if per_token != facts.attn_bytes_per_token:
                raise PlanError(
                    f"hybridkv's attention page for layers {layers} is {per_token} bytes per "
                    f"token, vLLM's is {facts.attn_bytes_per_token} (tensor-parallel size "
                    f"{facts.tp}); vLLM's rule is kept"
                )


def choose_block_size(facts: VllmFacts) -> VllmChoice:
    """hybridkv's block size and page padding for vLLM's worker, or a `PlanError` that
    says why vLLM's own rule should stay (the caller logs it and changes nothing)."""
    from hybridkv.models import load_model_spec

    try:
        main = load_model_spec(dict(facts.hf_config))
        draft = load_model_spec(dict(facts.draft_hf_config)) if facts.draft_hf_config else None
    except HybridKVError as err:
        raise PlanError(f"hybridkv cannot read this model's config: {err}") from err
    ours = plan(
        main,
        draft,
        options=_options(
            facts,
            layout="shared",
            block_align_tokens=facts.kernel_align_tokens,
            block_size=facts.user_block_size,
        ),
    )
    theirs = plan(
        main,
        draft,
        options=_options(facts, layout="vllm", block_align_tokens=facts.vllm_align_tokens),
    )
    _check_same_pages(ours, facts)
    attention = {g.block_size for g in ours.groups if not g.is_state}
    if len(attention) != 1 or len(ours.pools) != 1:
        raise PlanError(
            f"hybridkv's plan has attention blocks {sorted(attention)} in {len(ours.pools)} "
            "pools; vLLM's workers take one block size in one pool here, so vLLM's rule is kept"
        )
    (block,) = attention
    page = ours.pools[0].page_bytes
    attention_page = block * facts.attn_bytes_per_token
    vllm_page = facts.vllm_block_size * facts.attn_bytes_per_token
    return VllmChoice(
        block_size=block,
        page_bytes=page,
        state_page_padded=page if page > facts.state_page_bytes else None,
        attention_page_bytes=attention_page,
        state_padding=(page - facts.state_page_bytes) / facts.state_page_bytes,
        attention_padding=(page - attention_page) / attention_page,
        vllm_block_size=facts.vllm_block_size,
        vllm_state_padding=(vllm_page - facts.state_page_bytes) / facts.state_page_bytes,
        requests_per_gib=ours.capacity.max_concurrency_float,
        vllm_requests_per_gib=theirs.capacity.max_concurrency_float,
        ours=ours,
        theirs=theirs,
    )
