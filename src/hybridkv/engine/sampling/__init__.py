"""Sampling parameters, logits processing, token sampling and logprobs."""
