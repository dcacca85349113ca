"""A process that believes it has one GPU (put this folder on PYTHONPATH).

torch decides some devices from the accelerator the process sees, not from the job's
backend: ``fully_shard`` without a mesh asks ``torch._C._get_accelerator()``,
``init_device_mesh`` and Lightning ask ``torch.cuda``. On a machine with one GPU and
several gloo ranks, every process that is not told otherwise sees that GPU. This file
makes a CPU-only process answer those three questions as such a process would (one
CUDA device), while any real CUDA work still fails loudly ("Torch not compiled with
CUDA enabled"): code that reaches for the GPU fails here as it would there.

``COURSE_LIB_GPU_LOOKALIKE``:
- ``1``: the machine as it is. A process whose GPUs are hidden
  (``CUDA_VISIBLE_DEVICES=""``, what the launcher gives gloo ranks) sees none, as torch
  would; the notebook kernel and every other process see one.
- ``unhidden``: every process sees the GPU, hidden or not: a gloo rank that sees it
  anyway (a script of one's own under torchrun), which tests that the course's own
  devices and meshes come from the job's backend.

Only those questions are patched; the CPU build underneath is untouched.

Where a CUDA build sees a GPU (make gpu-check) nothing is patched: the machine answers
for itself, and ``unhidden`` lifts the launcher's hiding for real. Patching there would
tell torch's own internals of a GPU the hidden process cannot reach (on the H100 run of
2026-11-27 the optimizers' graph-capture check then failed with "no CUDA-capable device").
"""
import os

_mode = os.environ.get("COURSE_LIB_GPU_LOOKALIKE")
_hidden = os.environ.get("CUDA_VISIBLE_DEVICES") == ""
if _mode == "unhidden" or (_mode == "1" and not _hidden):
    import torch

    if _hidden:
        del os.environ["CUDA_VISIBLE_DEVICES"]  # CUDA reads it at its first call, not yet made
    if torch.version.cuda is None or torch.cuda.device_count() == 0:
        if _hidden:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        _cuda = torch.device("cuda")
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 1
        torch._C._get_accelerator = lambda: _cuda
