"""A CPU pool child runs torch's intra-op pool at one thread: the pool is the parallelism (`tasks.lifecycle`)."""

from __future__ import annotations

import torch

from tasks import lifecycle


def test_a_cpu_pool_child_runs_torch_at_one_thread() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        lifecycle._one_torch_thread()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
