"""The SLURM templates, run by bash with the cluster's commands standing in as scripts that
record their arguments (srun, scontrol, torchrun, python): what a node would execute."""
import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def fake_cluster(tmp_path, nodelist="gpu[07-08]"):
    """A bin/ folder with scontrol, srun, torchrun and python that log their argv, and a
    venv whose activate script is empty; returns the environment to run a template in."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    record = f'#!/bin/bash\necho "$(basename "$0") $*" >> {shlex.quote(str(log))}\n'
    scripts = {
        # a long allocation: the list outlasts one pipe write, as a real one of many nodes does
        "scontrol": ('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] || exit 1\n'
                     'printf "gpu07\\ngpu08\\n"; for i in $(seq 100 20100); do echo "gpu$i"; done\n'),
        "srun": record + 'exec "$@"\n',
        "torchrun": record,
        "python": record,
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "activate").write_text(f"export PATH={bin_dir}:$PATH\n")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "VENV": str(tmp_path / "venv"),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": nodelist, "SLURM_NNODES": "2",
           "SLURM_GPUS_ON_NODE": "4", "TMPDIR": str(tmp_path), "HOME": str(tmp_path)}
    return env, log


@pytest.mark.parametrize("name", ["papermill.sbatch", "torchrun.sbatch"])
def test_templates_are_valid_bash(name):
    subprocess.run(["bash", "-n", str(ROOT / "cluster" / name)], check=True)


def test_multinode_torchrun_meets_at_the_first_node(tmp_path):
    env, log = fake_cluster(tmp_path)
    env["SCRIPT"] = "train.py"
    subprocess.run(["bash", str(ROOT / "cluster" / "torchrun.sbatch"), "--steps", "3"],
                   cwd=tmp_path, env=env, check=True, timeout=30)
    srun, torchrun = log.read_text().splitlines()
    assert srun.startswith("srun torchrun")
    args = torchrun.split()
    assert args[args.index("--nnodes") + 1] == "2"
    assert args[args.index("--nproc-per-node") + 1] == "4"
    assert args[args.index("--rdzv-backend") + 1] == "c10d"
    assert args[args.index("--rdzv-endpoint") + 1] == "gpu07:29500"  # the first node
    assert args[args.index("--rdzv-id") + 1] == "4242"
    assert args[-3:] == ["train.py", "--steps", "3"]


def test_multinode_template_refuses_to_run_without_a_script(tmp_path):
    env, _ = fake_cluster(tmp_path)
    proc = subprocess.run(["bash", str(ROOT / "cluster" / "torchrun.sbatch")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "set SCRIPT" in proc.stderr


def test_papermill_template_runs_every_lab_on_nccl_with_a_rank_per_gpu(tmp_path):
    env, log = fake_cluster(tmp_path)
    env["ONLY"] = "02,03"
    subprocess.run(["bash", str(ROOT / "cluster" / "papermill.sbatch")], cwd=tmp_path, env=env,
                   check=True, timeout=30)
    (call,) = log.read_text().splitlines()
    assert call.split() == ["python", "-m", "course_lib.grading.runall", "--nproc", "4",
                            "--backend", "nccl", "--out", "runs/slurm-4242", "--only", "02,03"]
    assert (tmp_path / "runs" / "slurm-4242").is_dir()
