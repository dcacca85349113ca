"""Communication hooks: what DDP does with a bucket, replaced by your function.

A hook has torch's signature ``hook(state, bucket) -> Future[Tensor]``: it gets
a :class:`GradBucket` whose ``buffer()`` holds this rank's *local* gradients,
flattened (not yet divided by the world size K), and returns a future whose value is the
tensor of averaged gradients, same shape and dtype as the buffer. DDP waits for
it at the end of backward and writes it into the ``.grad`` of every parameter
of the bucket. Registering one::

    ddp.register_comm_hook(process_group, bf16_compress_hook)   # our DDP or torch's

The lecture's ``run_comm_hook`` is this loop: bucket ready -> hook -> future ->
gradients. :func:`allreduce_hook` is what DDP does with no hook;
:func:`bf16_compress_hook` halves the bytes on the wire by sending bfloat16.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class GradBucket:
    """The bucket as a hook sees it, with ``torch.distributed.GradBucket``'s
    methods, so that a hook written for torch's DDP runs on ours unchanged."""

    def __init__(self, bucket, is_last):
        self._bucket, self._is_last = bucket, is_last

    def index(self):
        return self._bucket.index

    def buffer(self):
        """The flat gradients (1-D, the bucket's dtype); a hook may modify it."""
        return self._bucket.buffer

    def set_buffer(self, tensor):
        self._bucket.buffer.copy_(tensor)

    def is_last(self):
        """True for the bucket all-reduced last in an iteration."""
        return self._is_last

    def parameters(self):
        return list(self._bucket.params)

    def gradients(self):
        return [self._bucket._view(slot).view_as(p) for slot, p in enumerate(self._bucket.params)]


def _group_size(process_group):
    return dist.get_world_size(process_group)


def allreduce_hook(process_group, bucket):
    """The default: divide by K, SUM all-reduce, the future of the averaged buffer."""
    tensor = bucket.buffer().div_(_group_size(process_group))
    work = dist.all_reduce(tensor, group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def bf16_compress_hook(process_group, bucket):
    """Send bfloat16 instead of float32: half the bytes, about 3 significant
    digits. The buffer is cast and divided by K, the SUM all-reduce runs in bf16,
    and the result is cast back into the float32 buffer."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(_group_size(process_group))
    work = dist.all_reduce(compressed, group=process_group, async_op=True)

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


def hook_result(future):
    """The reduced tensor a hook's future produced (a list of one tensor is
    accepted too: the raw future of ``dist.all_reduce``)."""
    value = future.value()
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"a communication hook's future must give the reduced bucket as a "
                        f"tensor, got {type(value).__name__}")
    return value
