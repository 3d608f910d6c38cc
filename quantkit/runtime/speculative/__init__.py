"""Speculative decoding: drafting (n-gram prompt lookup or a draft model) and verification in one target pass."""
