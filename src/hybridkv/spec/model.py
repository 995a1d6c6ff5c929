"""A whole model as the cache sees it: one `LayerSpec` per cache-holding layer."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from hybridkv.errors import SpecError
from hybridkv.spec.dtypes import DType
from hybridkv.spec.layers import AttentionSpec, LayerSpec, StateSpec


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Layers of one model (main, draft, or EAGLE/MTP head), in model order.

    ``layers`` lists the cache-holding layers in model order: decoder layers without a
    cache (Nemotron-H MLP / MoE layers) are skipped, and a decoder layer holding two
    caches (Falcon-H1: attention and Mamba2 in parallel) gives two entries;
    `hybridkv.models.registry.decoder_layer_indices` maps entries back to decoder
    layers. A model's MTP / EAGLE head is a separate `ModelSpec` (see `draft_head`),
    planned as draft layers.
    """

    name: str
    model_type: str
    layers: tuple[LayerSpec, ...]
    dtype: DType = DType.BFLOAT16
    max_position_embeddings: int | None = None
    num_mtp_layers: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        if not self.layers:
            raise SpecError(f"model {self.name!r} has no cache-holding layers")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kind_counts(self) -> dict[str, int]:
        """Layer count by kind, state layers split by family (``state:mamba2``)."""
        counts: Counter[str] = Counter()
        for layer in self.layers:
            key = f"state:{layer.family}" if isinstance(layer, StateSpec) else layer.kind
            counts[key] += 1
        return dict(counts)

    def layer_mix(self) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(self.kind_counts().items()))

    def shard(self, tp: int) -> ModelSpec:
        if tp < 1:
            raise SpecError(f"tensor parallel size must be >= 1, got {tp}")
        if tp == 1:
            return self
        return dataclasses.replace(self, layers=tuple(layer.shard(tp) for layer in self.layers))

    def with_dtypes(
        self, kv: DType | None = None, conv: DType | None = None, ssm: DType | None = None
    ) -> ModelSpec:
        return dataclasses.replace(
            self,
            layers=tuple(layer.with_dtypes(kv=kv, conv=conv, ssm=ssm) for layer in self.layers),
        )

    def draft_head(self, num_layers: int | None = None, *, method: str = "mtp") -> ModelSpec:
        """The EAGLE / MTP head of this model as a draft `ModelSpec`.

        The head's decoder layers are full-attention layers shaped like this model's
        full-attention layers (Qwen3-Next / Qwen3.5 MTP, DeepSeek MTP, EAGLE-3 all are).
        """
        count = num_layers if num_layers is not None else max(self.num_mtp_layers, 1)
        attn = [layer for layer in self.layers if type(layer) is AttentionSpec]
        template: LayerSpec | None = attn[0] if attn else None
        if template is None:
            others = [layer for layer in self.layers if layer.grows_with_tokens]
            template = others[0] if others else None
        if template is None:
            raise SpecError(
                f"model {self.name!r} has no attention layer to shape a {method} head on; "
                "give the draft as its own model instead"
            )
        if isinstance(template, AttentionSpec) and type(template) is not AttentionSpec:
            template = AttentionSpec(
                num_kv_heads=template.num_kv_heads,
                head_dim=template.head_dim,
                v_head_dim=template.v_head_dim,
                dtype=template.dtype,
            )
        return ModelSpec(
            name=f"{self.name}:{method}",
            model_type=f"{self.model_type}_{method}",
            layers=(template,) * count,
            dtype=self.dtype,
            max_position_embeddings=self.max_position_embeddings,
            source=f"{method} head of {self.name}",
        )
