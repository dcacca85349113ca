"""What the tensor-parallel tests share: groups of size t inside one job, seeded
tensors both the ranks and the test process can make, and the expected layout,
written here independently of course_lib.tp."""
import torch
import torch.distributed as dist


def tp_group(t):
    """This rank's group when the world is cut into consecutive groups of t
    ranks (the last may be smaller); None, the world itself, when t is the world."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if t == world:
        return None
    mine = None
    for start in range(0, world, t):  # every rank creates every group, in order
        ranks = list(range(start, min(start + t, world)))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def group_sizes(t, world):
    """[(first global rank, size)] of the groups :func:`tp_group` makes."""
    return [(start, min(t, world - start)) for start in range(0, world, t)]


def seeded(seed, *shape):
    # on the CPU, as the generator is: under NCCL a rank's default device is its GPU
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), device="cpu")


def randomize(module, seed=0):
    """Every parameter drawn at random, biases and LayerNorms included (zeros and
    ones would hide a bias added t times)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cpu") * 0.3)
    return module


def expected_shard(name, full, rank, t):
    """Rank ``rank``'s slice of the dense parameter ``name`` of a course Block (or
    of a lone column/row layer named "column.*" / "row.*")."""
    if name.endswith("qkv.weight"):  # by heads: this rank's rows of each of q, k, v
        return torch.cat([part.chunk(t, 0)[rank] for part in full.chunk(3, 0)])
    if name.startswith("column.") or name.endswith(("mlp.0.weight", "mlp.0.bias")):
        return full.chunk(t, 0)[rank]
    if name.endswith(("proj.weight", "mlp.2.weight", "row.weight")):
        return full.chunk(t, 1)[rank]
    return full  # LayerNorms and the row layers' biases: whole on every rank
