"""Speculative decoding: proposers (draft model, EAGLE-3 head, n-gram) and verification."""
