import os
import sys

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

# tests import the example's GPT (the model the example trains) as `examples.gpt`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def fake_world_of_two():
    """A fake process group of two ranks in this process (shapes real, values not)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()
