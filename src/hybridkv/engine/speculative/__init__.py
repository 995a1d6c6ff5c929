"""Speculative decoding in the engine: drafters and proposers, verification, token trees."""
