"""Speculative decoding: draft-token proposers (n-gram, suffix tree, draft model) and their bookkeeping."""
