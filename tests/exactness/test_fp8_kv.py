"""fp8 KV cache in the engine: pages stored as float8 (e4m3 / e5m2) with per-tensor scales
give exactly the tokens of the same engine whose float32 pages hold values rounded
through the same fp8 dtype (the oracle), for full, sliding-window and hybrid models,
with prefix caching and speculative decoding on; the checkpoint's k_scale / v_scale are
read and used. Agreement with transformers (fp32) is measured by bench/fp8_kv_agreement.py:
fp8 is not exact, so no test pins it."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from hybridkv.engine import LLM  # noqa: E402
from hybridkv.engine.forward.tensors import simulate_fp8_kv  # noqa: E402
from hybridkv.engine.ops.context import KVCache  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
NUM_NEW = 24


def oracle_llm(folder, kv_dtype: str, **kwargs) -> LLM:
    """The engine in float32 pages, every stored K/V rounded through ``kv_dtype``."""
    llm = LLM(folder, **kwargs)
    simulate_fp8_kv(llm.tensors, FP8[kv_dtype], llm.model.layers)
    return llm


def long_prefix_prompts(seed: int = 7) -> list[list[int]]:
    """Four prompts sharing a 150-token prefix: longer than the 64-token blocks a shared
    pool gives 1-byte attention pages of a tiny hybrid, so warm runs hit."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 128, (150,), generator=gen).tolist()
    return [system + torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 9, 14, 1)]


def attention_caches(llm: LLM) -> list[KVCache]:
    return [c for c in llm.tensors.caches.values() if isinstance(c, KVCache)]


@pytest.mark.parametrize(
    ("name", "kv_dtype"),
    [("qwen3", "fp8_e4m3"), ("gemma3", "fp8_e5m2"), ("qwen3_5", "fp8_e4m3")],
)
def test_fp8_pages_equal_fp8_rounding_oracle(llm_case, name, kv_dtype):
    case = llm_case(name)
    align = {"state_mode": "align", "chunk_size": 8} if case.hybrid else {}
    fp8 = LLM(case.folder, kv_dtype=kv_dtype, **align)
    caches = attention_caches(fp8)
    assert caches and all(c.key.dtype == FP8[kv_dtype] for c in caches)
    assert all(c.value.dtype == FP8[kv_dtype] for c in caches)
    oracle = oracle_llm(case.folder, kv_dtype, **align)
    assert all(c.key.dtype == torch.float32 for c in attention_caches(oracle))
    prompts = case.prompts + long_prefix_prompts()
    got = [r.token_ids for r in fp8.generate(prompts, NUM_NEW)]
    want = [r.token_ids for r in oracle.generate(prompts, NUM_NEW)]
    assert got == want
    # Warm cache: the second run reads fp8 pages other requests wrote.
    again = [r.token_ids for r in fp8.generate(prompts, NUM_NEW)]
    assert again == want
    assert fp8.stats().prefix_hit_tokens["attention"] > 0


def test_fp8_pages_hold_the_rounded_values(llm_case):
    """Not a no-op: the fp8 run's pages differ from float32 K/V, and reading them back
    gives exactly what the oracle's float32 pages hold."""
    case = llm_case("qwen3")
    prompt = [case.prompts[0]]
    same = dict(prefix_caching=False, block_size=16)  # same block ids in all three
    fp8 = LLM(case.folder, kv_dtype="fp8_e4m3", **same)
    fp8.generate(prompt, 1)
    oracle = oracle_llm(case.folder, "fp8_e4m3", **same)
    oracle.generate(prompt, 1)
    plain = LLM(case.folder, **same)
    plain.generate(prompt, 1)
    num_tokens = len(prompt[0])
    pages = 8  # the 46-token request's blocks are among the first pages handed out
    for index, cache in fp8.tensors.caches.items():
        assert isinstance(cache, KVCache)
        got = cache.key[:pages].float()
        want = oracle.tensors.caches[index].key[:pages]  # type: ignore[union-attr]
        base = plain.tensors.caches[index].key[:pages]  # type: ignore[union-attr]
        assert torch.equal(got, want)
        assert not torch.equal(got, base)
        assert int((got != 0).sum()) >= num_tokens  # the prompt's keys were stored


def _add_kv_scales(folder, scales: dict[int, tuple[float, float]]) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for layer, (k_scale, v_scale) in scales.items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scale)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([v_scale])
    save_file(tensors, str(path), metadata={"format": "pt"})


def _copy_case(case, tmp_path):
    import shutil

    dest = tmp_path / case.name
    shutil.copytree(case.folder, dest)
    return dest


def test_checkpoint_kv_scales_are_used(llm_case, tmp_path):
    """k_scale / v_scale from the checkpoint reach the pages (a scale of 0.02 maps the
    keys far outside e4m3's finite range without the clamp) and match the oracle."""
    case = llm_case("qwen3")
    folder = _copy_case(case, tmp_path)
    scales = {0: (0.02, 0.5), 1: (2.0, 0.25), 2: (0.75, 3.0)}
    _add_kv_scales(folder, scales)
    fp8 = LLM(folder, kv_dtype="fp8_e4m3")
    for index, cache in fp8.tensors.caches.items():
        assert isinstance(cache, KVCache) and cache.quant is not None
        assert (cache.quant.key_scale, cache.quant.value_scale) == pytest.approx(scales[index])
    got = [r.token_ids for r in fp8.generate(case.prompts, NUM_NEW)]
    unscaled = [
        r.token_ids for r in LLM(case.folder, kv_dtype="fp8_e4m3").generate(case.prompts, NUM_NEW)
    ]
    want = [r.token_ids for r in oracle_llm(folder, "fp8_e4m3").generate(case.prompts, NUM_NEW)]
    assert got == want
    assert got != unscaled  # the scales changed the numerics
    assert all(not torch.isnan(c.key.float()).any() for c in attention_caches(fp8))


def test_one_kv_scale_without_the_other_is_refused(llm_case, tmp_path):
    case = llm_case("qwen3")
    folder = _copy_case(case, tmp_path)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor(0.5)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(EngineError, match="v_scale"):
        LLM(folder, kv_dtype="fp8_e4m3")


def test_fp8_with_a_draft_model_and_speculation(llm_case):
    """Main (Gated DeltaNet hybrid) and draft (dense) both in fp8 pages, K = 3."""
    main, draft = llm_case("qwen3_5"), llm_case("qwen3")
    kwargs = dict(draft=draft.folder, num_spec_tokens=3)
    fp8 = LLM(main.folder, kv_dtype="fp8_e4m3", **kwargs)
    assert all(
        c.key.dtype == torch.float8_e4m3fn
        for c in fp8.tensors.draft_caches.values()
        if isinstance(c, KVCache)
    )
    oracle = LLM(main.folder, **kwargs)
    simulate_fp8_kv(
        oracle.tensors, torch.float8_e4m3fn, oracle.model.layers, oracle.draft_model.layers
    )
    plain = oracle_llm(main.folder, "fp8_e4m3")
    got = [r.token_ids for r in fp8.generate(main.prompts, NUM_NEW)]
    assert got == [r.token_ids for r in oracle.generate(main.prompts, NUM_NEW)]
    assert got == [r.token_ids for r in plain.generate(main.prompts, NUM_NEW)]
    assert fp8.stats().num_proposed_tokens > 0


def test_bad_kv_dtype_is_a_typed_error(llm_case):
    with pytest.raises(EngineError, match="kv_dtype 'fp7'"):
        LLM(llm_case("qwen3").folder, kv_dtype="fp7")


def test_config_json_untouched(llm_case):
    """The fp8 run changes nothing on disk (the plan alone sizes 1-byte pages)."""
    case = llm_case("qwen3")
    before = json.loads((case.folder / "config.json").read_text())
    LLM(case.folder, kv_dtype="fp8_e5m2")
    assert json.loads((case.folder / "config.json").read_text()) == before
