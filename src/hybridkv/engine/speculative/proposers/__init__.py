"""Draft proposers behind one interface (`Proposer`)."""

from hybridkv.engine.speculative.proposers.base import Proposer
from hybridkv.engine.speculative.proposers.ngram import NgramProposer, SuffixProposer

__all__ = ["NgramProposer", "Proposer", "SuffixProposer"]
