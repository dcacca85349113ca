"""What each lab's browser test does, as data: the exercise and the prediction typed into
the editor (a wrong answer, the hint its check must show for it; then the solution), the
pictures and tables the run must show, the ``%%torchrun`` output, and the widgets moved.

``wrong`` replaces the stub's ``raise NotImplementedError(...)`` line (at its
indentation); the right answer is the solution's cell. A widget step is ``(label,
action, value, expect, redraws)``: drag a slider's handle to ``value`` (a fraction of
its track), ``select`` the option ``value`` of a dropdown, or ``check`` a checkbox; the
interact's output must change, show as many pictures as before (new ones, where
``redraws``), and hold ``expect`` (``{value}``: the control's value after) if given.
"""
from dataclasses import dataclass, field


@dataclass
class Typed:
    item: str      # "Exercise 0.3", "Prediction 0.1"
    wrong: str     # the body typed in place of the stub's raise
    hint: str      # what the check shows for that mistake


@dataclass
class Lab:
    name: str
    exercise: Typed
    prediction: Typed
    images: int                 # at least this many pictures, each of non-zero size
    tables: int = 0             # at least this many rendered tables
    shows: tuple = ()           # text the run must show somewhere
    widgets: dict = field(default_factory=dict)  # a snippet of the cell -> [steps]


LABS = [
    Lab("00_launch",
        Typed("Exercise 0.3", "out = torch.empty_like(x)\n"
              "comm.exchange(sends=[(x, (rank - 1) % world)], recvs=[(out, (rank + 1) % world)])\n"
              "return out", "send to (rank + 1) % n, receive from (rank - 1) % n"),
        Typed("Prediction 0.1", "return alpha / bandwidth",
              "seconds over bytes per second is not a size"),
        images=2, tables=1, shows=("[rank0]", "[rank1] I am rank 1 of")),  # %%torchrun
    Lab("01_collectives",
        Typed("Exercise 1.1", "if world == 1:\n    return tensor\nif rank == 0:\n"
              "    incoming = torch.empty_like(tensor)\n    for peer in range(1, world):\n"
              "        comm.exchange(recvs=[(incoming, peer)])\n"
              "        combine(tensor, incoming, op)\nelse:\n"
              "    comm.exchange(sends=[(tensor, 0)])\nreturn tensor",  # no result sent back
              "every other rank sends its tensor to rank 0 and receives the result from rank 0"),
        Typed("Prediction 1.2", "return (k - 1) * (alpha + n_bytes / (k * bandwidth))",
              "that is one phase; the all-gather's K-1 steps follow the reduce-scatter's"),
        images=6,
        widgets={"widgets.interact(show_ring": [("step", "drag", 1.0, None, True),
                                                ("step", "drag", 0.0, None, True)]}),
    Lab("02_ddp",
        Typed("Exercise 2.1", "for p in model.parameters():\n    if p.grad is not None:\n"
              "        dist.all_reduce(p.grad)", "the SUM all-reduce divided by the world size"),
        Typed("Prediction 2.2", "return 1", "backward adds into .grad"),
        images=5),
    Lab("03_memory_fsdp",
        Typed("Exercise 3.1", "return N * (12 * D * D) + D * (V + T) + 2 * D + V * (D + 1)",
              "Hint: P = N(12D^2 + 10D) + D(V + T) + 2D + V(D + 1)"),
        Typed("Prediction 3.1", 'passes = {"ddp": 2, "zero1_all_reduce": 3, '
              '"zero1_reduce_scatter": 2, "fsdp_full": 3, "fsdp_grad_op": 2}[strategy]\n'
              'return passes * (n - 1) / n * P',
              "P parameters of fp32 are 4P bytes"),
        images=5,
        widgets={"interact(calculator": [
            ("model", "select", "OLMo 70B", None, True), ("n", "drag", 0.9, None, True),
            # the picture shows every stage: the stage picks only the line printed
            ("stage", "drag", 0.0, "ZeRO-{value}: state", False),
            ("batch", "drag", 0.8, None, True), ("checkpointing", "check", None, None, True)]}),
    Lab("04_pipeline",
        Typed("Exercise 4.1",
              'return [[Action(k, i) for i in range(m) for k in ("F", "B")] for _ in range(p)]',
              "GPipe runs every forward before any backward"),
        Typed("Prediction 4.1", "return (p - 1) / m", "that is idle time over busy time"),
        images=8,
        widgets={"explorer()": [
            ("kind", "select", "interleaved", "interleaved: bubble", True),
            ("p", "drag", 0.2, None, True), ("m", "drag", 0.9, None, True),
            ("v", "drag", 1.0, None, True), ("t_b", "drag", 0.1, None, True),
            ("t_comm", "drag", 0.9, None, True)]}),
    Lab("05_tensor_parallel",
        Typed("Exercise 5.4", "return weight.chunk(t, dim=0)[rank]",
              "a contiguous slice gives rank 0 all of q's rows and none of v's"),
        Typed("Prediction 5.1", "return 4", "one per linear layer is too many"),
        images=3),
    Lab("06_capstone",
        Typed("Exercise 6.2", "d, v, t, n = cfg.dim, cfg.vocab, cfg.seq_len, cfg.layers\n"
              "return d * (v + t) + n * (12 * d * d + 10 * d) + 2 * d + v * (d + 1)",
              "a block's matrices (q/k/v, projection, both MLP layers)"),
        Typed("Prediction 6.2", "return 16 * params / (tp * pp)",
              "ZeRO shards over the dp replicas"),
        images=2),
    Lab("07_sequences_experts",
        Typed("Exercise 7.2", "return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)",
              "that is the average of the two: each block must weigh by its share"),
        Typed("Prediction 7.1", "return 4 * (6 * b * s * h + b * heads * s)",
              "each rank keeps only its own s/cp tokens' tensors"),
        images=6),
    Lab("08_fault_tolerance",
        Typed("Exercise 8.1", "return [((start,), (length,))]",
              "is not (offsets, sizes) with 2 whole numbers each"),
        Typed("Prediction 8.1", "return 4 * P / n", "the optimizer's state is saved too"),
        images=3),
]
