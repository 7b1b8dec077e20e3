"""LiveTensorBytes counts storages once, sees temporaries in its peak, and forgets freed ones."""

import torch

from zero_fx.analysis.live_memory import LiveTensorBytes

FLOAT = 4


def test_counts_existing_new_and_freed_storages():
    existing = torch.zeros(100)
    probe = LiveTensorBytes([existing, existing.view(10, 10)])  # one storage, counted once
    assert probe.live == probe.peak == 100 * FLOAT
    with probe:
        a = torch.ones(50)
        view = a[:10]  # no new storage
        temporary = a * 2
        del temporary
        assert probe.live == 150 * FLOAT and probe.peak == 200 * FLOAT
        del a
        assert probe.live == 150 * FLOAT  # the view keeps a's storage alive
        del view
    assert probe.live == 100 * FLOAT and probe.peak == 200 * FLOAT
    probe.reset_peak()
    assert probe.peak == 100 * FLOAT
