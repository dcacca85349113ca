import pytest
import torch
from torch.utils.data import DistributedSampler

from course_lib.data import ShardedSampler, batches, char_corpus, regression_batch


@pytest.mark.parametrize("length,world,drop_last", [(10, 3, False), (10, 3, True), (7, 2, False),
                                                    (4, 4, False), (2, 3, False), (1, 4, False),
                                                    (2, 5, False), (3, 8, True)])
def test_sharded_sampler_matches_torch_distributed_sampler(length, world, drop_last):
    for epoch in (0, 3):
        for rank in range(world):
            ours = ShardedSampler(length, rank, world, seed=5, drop_last=drop_last)
            theirs = DistributedSampler(range(length), num_replicas=world, rank=rank, seed=5,
                                        drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_shards_are_disjoint_and_cover_the_data():
    shards = [list(ShardedSampler(12, r, 3)) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(12))
    with pytest.raises(ValueError):
        ShardedSampler(5, 3, 3)


def test_char_corpus_windows_and_batches():
    x, y, vocab = char_corpus(16)
    assert x.shape == y.shape and x.shape[1] == 16 and len(vocab) > 20
    assert torch.equal(x[0, 1:], y[0, :-1])  # targets are inputs shifted by one
    got = list(batches(x, y, ShardedSampler(len(x), 0, 2, shuffle=False), 4))
    assert len(got) == len(ShardedSampler(len(x), 0, 2)) // 4
    assert torch.equal(got[0][0], x[torch.tensor([0, 2, 4, 6])])
    xr, yr = regression_batch(5, inputs=3, outputs=2)
    assert xr.shape == (5, 3) and yr.shape == (5, 2)
