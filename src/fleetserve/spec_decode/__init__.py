"""Speculative decoding: proposers (n-gram lookup, draft model) and the rejection sampler."""
