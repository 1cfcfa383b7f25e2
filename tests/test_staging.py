"""splitspec/staging.py: a device tensor's host twin (on CPU here: plain memory)."""

import torch

from splitspec.staging import HostTwin


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
