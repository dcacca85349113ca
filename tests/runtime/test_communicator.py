"""NCCL's communicator steps as Lab 00 shows them: the unique id goes out of band through
the job's own store (real gloo jobs, 1-3 ranks), and the single-process all-reduce refuses
what NCCL cannot take (tests/gpu runs it on a GPU)."""
import pytest
import torch
import torch.distributed as dist

from conftest import ship_by_value
from course_lib import run
from course_lib.runtime.communicator import (UNIQUE_ID_BYTES, exchange_unique_id,
                                             one_process_all_reduce, unique_id_job)

ship_by_value(__name__)


@pytest.mark.parametrize("world", [1, 3])
def test_every_rank_gets_rank_0s_id_through_the_jobs_store(world):
    got = run(unique_id_job, nproc=world, timeout=60)
    assert len(got) == world and len(set(got)) == 1 and got[0][0] == UNIQUE_ID_BYTES


def test_a_second_key_gets_a_fresh_id():
    def two_ids():
        return unique_id_job("a")[1], unique_id_job("b")[1]

    ids = run(two_ids, nproc=2, timeout=60)
    assert ids[0] == ids[1] and ids[0][0] != ids[0][1]


def test_a_non_zero_rank_waits_for_the_id_it_is_given():
    store = dist.HashStore()
    store.set_timeout(__import__("datetime").timedelta(seconds=1))
    with pytest.raises(Exception):  # rank 1 asks before rank 0 set it: it times out
        exchange_unique_id(store, 1, "k")
    mine = exchange_unique_id(store, 0, "k")
    assert exchange_unique_id(store, 1, "k") == mine and len(mine) == UNIQUE_ID_BYTES


def test_the_single_process_all_reduce_takes_one_gpu_tensor_per_device():
    with pytest.raises(ValueError, match="one tensor per GPU"):
        one_process_all_reduce([torch.ones(4)])
    with pytest.raises(ValueError, match="one tensor per GPU"):
        one_process_all_reduce([])
