"""Saved from our FSDP on 4 gloo ranks (parameters and AdamW's moments as flat ranges),
restored into tensor parallelism on 2 ranks, FSDP on 3 and one process: the same
parameters, and the same losses over the AdamW steps that followed the save."""
import torch

from conftest import ship_by_value
from course_lib import run
from course_lib.checkpoint import consolidate, reshard
from course_lib.checkpoint.state import restore

ship_by_value(__name__)


def test_fsdp_on_4_restores_into_tp_on_2_fsdp_on_3_and_one_process(tmp_path):
    # 24 x 24 weights (reshard.config): uneven shards on 3 and 4 ranks
    want = run(reshard.train_and_save, tmp_path, with_dcp=False, nproc=4, timeout=180)[0]
    path = tmp_path / "ours"
    saved = consolidate(path)
    model, opt = reshard.build("plain")
    restore(path, model, opt)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name
        assert torch.equal(opt.state[p]["exp_avg"], saved[f"optim.{name}.exp_avg"]), name
    assert torch.allclose(torch.tensor(reshard.continue_from(path, "plain")["losses"]),
                          torch.tensor(want["losses"]), atol=1e-6)
    for layout, n in (("tp", 2), ("fsdp", 3)):
        for out in run(reshard.continue_from, path, layout, nproc=n, timeout=180):
            assert torch.allclose(torch.tensor(out["losses"]), torch.tensor(want["losses"]),
                                  atol=1e-5), layout
