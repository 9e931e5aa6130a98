"""Speculative decoding: proposals (prompt lookup, a draft model) verified by the target."""
