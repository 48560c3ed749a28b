"""Pooling models (embeddings, cross-encoder scores): configuration, input processing and the offline API."""
