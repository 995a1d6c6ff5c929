"""From model specs to layer classes (same model, same spec) and groups of layers.

A *class* is every layer of one model with one exact spec (after dtype overrides and
tensor-parallel sharding). Layouts cut classes into *groups*: layers that share one
block table per request. In a pool shared by several groups, every group should have
the same number of layers so that one block id covers the same bytes in each::

    class A (12 attn layers)   -> 1 group of 12
    class B (36 GDN layers)    -> 3 groups of 12      (group size n = 12)
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.errors import PlanError, SpecError
from hybridkv.ids import cdiv
from hybridkv.plan.types import LayerRef, PlanOptions
from hybridkv.spec.layers import AttentionSpec, LayerSpec, MLASpec, StateSpec
from hybridkv.spec.model import ModelSpec


@dataclass(frozen=True)
class LayerClass:
    model: str
    spec: LayerSpec
    layers: tuple[LayerRef, ...]

    @property
    def has_main(self) -> bool:
        """Holds main-model layers (``main`` or a merged ``main+draft`` class)."""
        return self.model.startswith("main")

    @property
    def is_state(self) -> bool:
        return isinstance(self.spec, StateSpec)

    def bytes_per_token(self) -> int:
        """Bytes one token costs in one layer (attention-like classes only)."""
        assert isinstance(self.spec, AttentionSpec | MLASpec)
        return self.spec.bytes_per_token()

    def state_page_bytes(self, num_spec_states: int) -> int:
        return self.spec.page_bytes(0, num_spec_states)

    def chunks(self, group_size: int) -> list[tuple[LayerRef, ...]]:
        """The class's layers cut into groups of at most ``group_size`` layers."""
        count = cdiv(len(self.layers), group_size)
        return [self.layers[i * group_size : (i + 1) * group_size] for i in range(count)]


def _prepare(model: ModelSpec, role: str, options: PlanOptions) -> ModelSpec:
    try:
        spec = model.with_dtypes(
            kv=options.kv_dtype, conv=options.conv_dtype, ssm=options.ssm_dtype
        )
        return spec.shard(options.tp)
    except SpecError as err:
        raise PlanError(f"{role} model {model.name!r} at tp={options.tp}: {err}") from err


def layer_classes(
    main: ModelSpec, draft: ModelSpec | None, options: PlanOptions
) -> list[LayerClass]:
    """Classes of main then draft layers, in order of first appearance; a draft model
    keeps its own classes even where its specs equal the main model's."""
    classes: list[LayerClass] = []
    for role, model in (("main", main), ("draft", draft)):
        if model is None:
            continue
        prepared = _prepare(model, role, options)
        by_spec: dict[LayerSpec, list[LayerRef]] = {}
        for index, spec in enumerate(prepared.layers):
            by_spec.setdefault(spec, []).append(LayerRef(model=role, index=index))
        classes.extend(LayerClass(role, spec, tuple(refs)) for spec, refs in by_spec.items())
    return classes


def merge_equal_specs(classes: list[LayerClass]) -> list[LayerClass]:
    """One class per distinct spec across both models, as vLLM groups layers (an MTP
    head shaped like the main attention layers joins them); model ``main+draft``."""
    merged: dict[LayerSpec, LayerClass] = {}
    for cls in classes:
        if cls.spec in merged:
            first = merged[cls.spec]
            model = first.model if first.model == cls.model else "main+draft"
            merged[cls.spec] = LayerClass(model, cls.spec, first.layers + cls.layers)
        else:
            merged[cls.spec] = cls
    return list(merged.values())


def group_size_candidates(classes: list[LayerClass]) -> list[int]:
    """Layers per group worth trying in a shared pool: each class size and their gcd."""
    sizes = sorted({len(c.layers) for c in classes})
    gcd = sizes[0]
    for size in sizes[1:]:
        while size:
            gcd, size = size, gcd % size
    return sorted(set(sizes) | {gcd})


def vllm_group_size(classes: list[LayerClass]) -> int:
    """vLLM 0.33's rule: the smallest class size, or the largest one when every class is
    within 25% of the smallest (vllm/v1/core/kv_cache_utils.py, uniform-page grouping)."""
    sizes = [len(c.layers) for c in classes]
    smallest, largest = min(sizes), max(sizes)
    return largest if largest < smallest * 1.25 else smallest
