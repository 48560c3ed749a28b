"""Shared fixtures for the benchmark tests: the embedded model's real tokenizer."""

import pytest

from pagemill.benchmarks.model_path import default_model_path, load_hf_tokenizer


@pytest.fixture(scope="session")
def default_model() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(default_model):
    return load_hf_tokenizer(default_model)
