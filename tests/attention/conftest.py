"""The attention kernel tests run on each ISA variant this CPU can execute."""

import pytest


@pytest.fixture(autouse=True)
def _every_kernel_variant(kernel_isa):
    yield
