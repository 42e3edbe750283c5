"""A fresh dynamo around every torch.compile test: no graph, guard or
recompilation count of one test reaches the next."""

import pytest


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
