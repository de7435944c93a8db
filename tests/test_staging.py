"""Host staging of an asynchronous save (`staging.HostStager`), in-process.

The stager keeps the views of its buffer from one save to the next while the tensors' dtypes and
shapes stay the same (every save of a run): each save must still copy the current values, and a
different set of tensors must get fresh views (never a stale or overlapping one).
"""

from __future__ import annotations

import torch

from megatron_ucp.staging import HostStager


def test_kept_views_receive_each_saves_values():
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(n, generator=g) for n in (5, 1000, 3)] + [torch.arange(4, dtype=torch.int64)]
    for batched in (True, False):
        stager = HostStager(batched=batched)
        first = stager.stage(src)
        assert all(torch.equal(a, b) for a, b in zip(first, src))
        for t in src:
            t.add_(1)  # training moves on
        again = stager.stage(src)
        assert [a is b for a, b in zip(again, first)] == [True] * 4  # the same views, refilled
        assert all(torch.equal(a, b) for a, b in zip(again, src))
        assert stager.allocations == 1


def test_another_layout_gets_fresh_views_of_the_same_buffer():
    stager = HostStager()
    a, b = torch.randn(600), torch.randn(2, 3, dtype=torch.float64)
    stager.stage([a, b])
    # same total size, other shapes and order: no view of the previous layout may be reused
    c, d = torch.randn(3, 2, dtype=torch.float64), torch.randn(20, 30)
    out = stager.stage([c, d])
    assert torch.equal(out[0], c) and torch.equal(out[1], d) and out[1].shape == (20, 30)
    assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()  # one buffer
    assert stager.allocations == 1
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in out)
    assert ends[0][1] <= ends[1][0]  # the copies do not overlap
