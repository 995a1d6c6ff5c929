"""Layer specs: one frozen dataclass per layer kind, each owning its byte arithmetic.

A spec is always *per tensor-parallel rank*: adapters build the unsharded spec and
`shard(tp)` divides heads / channels. Nothing outside this module multiplies heads by
dtype sizes.

Two families:

* attention-like specs (`AttentionSpec`, `SlidingWindowSpec`, `ChunkedLocalSpec`,
  `MLASpec`): a page holds ``block_size`` tokens, so page bytes grow with the block size;
* state specs (`StateSpec` subclasses): one page is one whole recurrent state (conv rows
  + ssm / recurrent matrix) and never depends on the block size. Conv-based states of
  the families that verify drafts in one pass (Gated DeltaNet, Mamba2) keep ``S`` extra
  conv rows, one per speculative token, so that the state at any accepted draft position
  can be recovered:

      conv rows = kernel - 1 + S          (S = num_spec_tokens)
"""

from hybridkv.spec.attention import (
    AttentionSpec,
    ChunkedLocalSpec,
    MLASpec,
    SlidingWindowSpec,
)
from hybridkv.spec.base import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    KINDS,
    MLA,
    SLIDING_ATTENTION,
    STATE,
    LayerSpec,
)
from hybridkv.spec.state import (
    STATE_FAMILIES,
    GatedDeltaNetSpec,
    KDASpec,
    LightningSpec,
    Mamba1Spec,
    Mamba2Spec,
    ShortConvSpec,
    StateSpec,
)

__all__ = [
    "CHUNKED_ATTENTION",
    "FULL_ATTENTION",
    "KINDS",
    "MLA",
    "SLIDING_ATTENTION",
    "STATE",
    "STATE_FAMILIES",
    "AttentionSpec",
    "ChunkedLocalSpec",
    "GatedDeltaNetSpec",
    "KDASpec",
    "LayerSpec",
    "LightningSpec",
    "MLASpec",
    "Mamba1Spec",
    "Mamba2Spec",
    "ShortConvSpec",
    "SlidingWindowSpec",
    "StateSpec",
]
