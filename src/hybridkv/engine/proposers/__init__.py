"""Draft proposers behind one interface (`Proposer`)."""

from hybridkv.engine.proposers.base import Proposer
from hybridkv.engine.proposers.ngram import NgramProposer, SuffixProposer

__all__ = ["NgramProposer", "Proposer", "SuffixProposer"]
