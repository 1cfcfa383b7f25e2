"""splitspec/staging.py: a device tensor's host twin and byte rows staged for a device (on
CPU here: plain memory)."""

import numpy as np
import torch

from splitspec.staging import HostTwin, RowStaging, reuse


def test_host_twin_reaches_its_target_only_when_sent():
    target = torch.zeros(2, 3, dtype=torch.int32)
    twin = HostTwin(target)
    twin.wait()  # nothing sent yet: returns at once
    twin.array[1, 2] = 7  # the numpy view writes the host twin
    assert twin.host[1, 2] == 7 and target.sum() == 0
    twin.send()
    assert target.tolist() == [[0, 0, 0], [0, 0, 7]]
    twin.array[0, 0] = 5
    twin.send(record=False)
    assert target[0, 0] == 5 and not twin.host.is_pinned()


def test_row_staging_sends_the_parts_in_order_and_each_result_is_its_own():
    staging = RowStaging("cpu")
    parts = [np.arange(6, dtype=np.uint8).reshape(2, 3), np.full(4, 9, dtype=np.uint8),
             np.zeros(0, dtype=np.uint8)]
    first = staging.send(parts)
    assert first.tolist() == [0, 1, 2, 3, 4, 5, 9, 9, 9, 9]
    second = staging.send([np.full(20, 7, dtype=np.uint8)])  # larger: the buffer grows
    assert second.tolist() == [7] * 20
    assert first.tolist() == [0, 1, 2, 3, 4, 5, 9, 9, 9, 9]  # not the reused buffer
    assert staging.send([]).numel() == 0


def test_reuse_keeps_a_buffer_that_is_long_enough_and_at_least_doubles_one_that_is_not():
    buffer = torch.empty((0, 3), dtype=torch.bfloat16)
    first = reuse(buffer, 5, pin=False)
    assert first.shape == (5, 3) and first.dtype == torch.bfloat16 and not first.is_pinned()
    assert reuse(first, 4, pin=False) is first and reuse(first, 5, pin=False) is first
    assert reuse(first, 6, pin=False).shape == (10, 3)   # twice as long
    assert reuse(first, 13, pin=False).shape == (13, 3)  # or as long as asked
