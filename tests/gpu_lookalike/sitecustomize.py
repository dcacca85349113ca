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
"""
import os

_mode = os.environ.get("COURSE_LIB_GPU_LOOKALIKE")
if _mode == "unhidden" or (_mode == "1" and os.environ.get("CUDA_VISIBLE_DEVICES") != ""):
    import torch

    _cuda = torch.device("cuda")
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch._C._get_accelerator = lambda: _cuda
