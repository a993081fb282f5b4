"""Fixtures of the GPU parity suite: fresh seeds, printed when a test fails."""

from __future__ import annotations

import os

import pytest
import torch
from gpu_support import DEVICE


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from os.urandom (or KVARN_TEST_SEED, to replay a failure); the seed
    is printed when a test fails and kept in the JSON report."""
    env = os.environ.get("KVARN_TEST_SEED")
    seed = int(env) if env else int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    g = torch.Generator(device=DEVICE)
    g.manual_seed(seed)
    print(f"seed={seed}")
    return g
