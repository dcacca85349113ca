# One entry point for students, instructors and CI. Every target sets up first;
# setup is idempotent (a stamp file), so a second `make test` installs nothing.
PYTHON ?= python3
VENV ?= .venv
# GPU users: make setup TORCH_SPEC="torch --index-url <your CUDA wheel index>"
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.course-installed
NPROC ?= 2
SUBMISSIONS ?= submissions
# executed notebooks, feedback pages and outputs go beside the gradebook
GRADEBOOK ?= grades/gradebook.csv
GRADE_TIMEOUT ?= 900
JOBS ?= 1

.PHONY: setup sandbox run test test-slow test-nccl-rules test-gpu test-gpu1 test-torch-oldest test-browser salt-sweep lab \
	labs grade bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $@

# The gradebook runs each submission in Debian's bubblewrap (bwrap): installed here when
# missing and we are root; otherwise grading still runs and flags every row "unsandboxed".
sandbox:
	@command -v bwrap >/dev/null || { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; \
		else echo "bwrap is missing and we are not root: grading will run unsandboxed"; fi; }

# make run NPROC=4 BACKEND=nccl ONLY=02,03 QUICK=0 OUT=runs/mine: parameters go through
# papermill (without NPROC each notebook keeps its own default)
QUICK ?= 1
BACKEND ?= auto
run: setup
	$(BIN)/python -m course_lib.grading.runall $(if $(filter 1,$(QUICK)),--quick) \
		$(if $(filter command line environment,$(origin NPROC)),--nproc $(NPROC)) \
		--backend $(BACKEND) $(if $(ONLY),--only $(ONLY)) $(if $(OUT),--out $(OUT))

# Every job of the suite sees one GPU in its ranks and kernels (tests/gpu_lookalike: the
# student's one-GPU machine, where gloo ranks must never touch CUDA); test-nccl-rules runs
# the same distributed tests and notebooks on plain CPU ranks.
test: setup sandbox
	COURSE_LIB_GPU_LOOKALIKE=1 $(BIN)/python -m pytest --durations=15

# the slowest tests (grading the real Lab 00 and a class of 15, launches over and over): CI runs them after `make test`
test-slow: setup sandbox
	$(BIN)/python -m pytest tests -m slow -p no:cacheprovider --durations=25

# The solutions graded by the gradebook under SWEEPS class secrets: each draws other hidden
# settings (a salt for torch's seeds, new sizes and cases), and every one must still pass
SWEEPS ?= 4
SWEEP_NAME ?= sweep
salt-sweep: setup sandbox
	rm -rf runs/salt-sweep && mkdir -p runs/salt-sweep/subs
	for f in solutions/[0-9]*.ipynb; do cp $$f runs/salt-sweep/subs/; done
	for k in $$(seq 1 $(SWEEPS)); do \
	  COURSE_LIB_GRADING_SECRET=$(SWEEP_NAME)-$$k $(BIN)/python -m course_lib.grading.gradebook \
	    runs/salt-sweep/subs --out runs/salt-sweep/$$k/gradebook.csv --jobs 2 || exit 1; done
	$(BIN)/python -c "import csv, glob, sys; bad = [(p, r['student'], r['exercise'], r['message'][:300]) \
	  for p in glob.glob('runs/salt-sweep/*/gradebook.details.csv') for r in csv.DictReader(open(p)) \
	  if r['status'] != 'pass']; print(*bad, sep='\n'); sys.exit(1 if bad else 0)"

# The distributed tests with gloo keeping NCCL's rules (course_lib/runtime/nccl_rules.py):
# what would hang or break on a GPU cluster fails here. Every lab's notebook runs under the
# rules in make test-browser (its JupyterLab exports COURSE_LIB_NCCL_RULES=1); add
# RULES_TESTS="... solutions" to run the solutions under nbval with them too.
RULES_TESTS ?= tests/collectives tests/ddp tests/fsdp tests/pipeline tests/tp tests/hybrid tests/cp tests/ep \
	tests/checkpoint \
	tests/test_comm.py tests/test_mesh.py tests/runtime/test_nccl_rules.py
test-nccl-rules: setup
	COURSE_LIB_NCCL_RULES=1 $(BIN)/python -m pytest $(RULES_TESTS) -p no:cacheprovider --durations=10

# One GPU (what a one-GPU machine can check): every solution notebook on NCCL at world
# size 1, quick setting, and the CUDA paths of a rank (devices, streams, events, memory)
test-gpu1: setup
	$(BIN)/python -m course_lib.grading.runall --quick --nproc 1 --backend nccl --out runs/gpu1
	$(BIN)/python -m pytest tests/gpu/test_one_gpu.py -v -rs -p no:cacheprovider

# The oldest torch the course claims (pyproject's range), in a venv of its own: the tests
# where torch's own APIs pick devices and dispatch (FSDP2's default mesh, the restore after
# context parallelism), ring attention on torch's fused kernels, and Lab 07. Without a
# CPU wheel index this downloads torch's CUDA build (GBs):
#   make test-torch-oldest TORCH_OLDEST="torch==2.11.0 --index-url <CPU wheel index>"
TORCH_OLDEST ?= torch==2.11.0
OLDEST_VENV ?= .venv-torch-oldest
test-torch-oldest:
	$(MAKE) setup VENV=$(OLDEST_VENV) TORCH_SPEC="$(TORCH_OLDEST)"
	$(OLDEST_VENV)/bin/python -m pytest tests/test_one_gpu_gloo.py tests/cp tests/bench/test_cp.py \
		tests/fsdp solutions/07_sequences_experts.ipynb -p no:cacheprovider

# NCCL on real GPUs (each test skips, saying why, where fewer GPUs are visible)
test-gpu: setup
	$(BIN)/python -m pytest tests/gpu tests/tp/test_nccl.py tests/hybrid/test_hybrid_nccl.py \
		"tests/pipeline/test_runs.py::test_on_nccl_the_pipeline_trains_as_one_process_and_traces_its_actions" \
		-v -rs -p no:cacheprovider

# Every lab in JupyterLab in headless Chromium, worked as a student works it (one server,
# one test per lab, and an interrupted deadlock; tests/browser). Playwright drives Debian's
# chromium (installed here when missing and we are root; the tests skip, saying why,
# otherwise); screenshots land in runs/browser/, the slowest tests' times are printed.
test-browser: setup
	$(BIN)/python -m pip install --quiet "playwright>=1.40"
	@command -v chromium >/dev/null || { if [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
		else echo "chromium is missing and we are not root: the browser test will skip"; fi; }
	$(BIN)/python -m pytest tests/browser -m browser -v -rs -p no:cacheprovider --durations=12

# make gpu-check: the one command for a machine with one GPU (course_lib/bench/gpucheck.py):
# every solution notebook at NPROC=1 on NCCL side by side, nbval with the notebooks' own
# defaults, tests/gpu and the world-1 benchmarks, in about 6 minutes on an H100. It writes
# reference/<gpu>/summary.json (and timelines/), prints the README's "Where this was
# tested" row, and exits non-zero if anything failed.
# A GPU image brings its own CUDA build of torch, and that one must stay (setup's .venv
# would install a fresh torch). So gpu-setup makes a venv of its own, $(GPU_VENV), with
# --system-site-packages: the interpreter's torch is seen there and kept, and the image
# itself is left as it was (installing into the system interpreter in place is refused by
# Debian's Python, PEP 668, and would change the image). pip installs the course and its
# other dependencies there under a constraint pinning the torch that is present (pip
# fails rather than replace it), from the registries or, offline, from a folder of wheels:
#   make gpu-check WHEELS=/path/to/wheels PYTHON=python3.12 GPU_CHECK_ARGS="--budget-s 0"
# Where PYTHON is itself a venv (the GPU image's python3 is /opt/torch/.venv/bin/python3),
# --system-site-packages sees only the base interpreter's packages, so a .pth file adds
# that venv's site-packages behind ours: its torch is seen, and the image is still untouched.
# To install into such a venv in place instead: make gpu-check GPU_VENV=/path/to/that/venv
GPU_VENV ?= .venv-gpu
GPU_BIN := $(GPU_VENV)/bin
GPU_STAMP := $(GPU_VENV)/.course-installed
GPU_CHECK_ARGS ?=
PIP_FROM := $(if $(WHEELS),--no-index --find-links $(WHEELS))

.PHONY: gpu-setup gpu-check

gpu-setup: $(GPU_STAMP)

$(GPU_STAMP): pyproject.toml
	@test -x $(GPU_BIN)/python || { $(PYTHON) -c "import torch" 2>/dev/null || { echo "$(PYTHON) has no torch:" \
		"make gpu-check keeps the torch of the machine (PYTHON=... names the interpreter that has it;" \
		"make setup TORCH_SPEC=... installs a fresh one in .venv)"; exit 1; }; \
		$(PYTHON) -m venv --system-site-packages $(GPU_VENV); \
		$(GPU_BIN)/python -c "import torch" 2>/dev/null || $(PYTHON) -c "import site; print(*site.getsitepackages(), sep=chr(10))" \
			> "$$($(GPU_BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_machine_torch.pth"; }
	@$(GPU_BIN)/python -c "import torch" 2>/dev/null || { echo "$(GPU_VENV) sees no torch: where torch" \
		"is in a venv of its own, make gpu-check GPU_VENV=<that venv>"; exit 1; }
	@# the installed distribution's version, not torch.__version__: a CUDA wheel from PyPI is
	@# 2.11.0 to pip and 2.11.0+cu130 to torch, and pip finds no torch==2.11.0+cu130 for it
	$(GPU_BIN)/python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > $(GPU_VENV)/constraints.txt
	$(GPU_BIN)/python -c "import setuptools as s, sys; sys.exit(tuple(map(int, s.__version__.split('.')[:2])) < (70, 1))" \
		2>/dev/null || $(GPU_BIN)/python -m pip install --quiet $(PIP_FROM) "setuptools>=70.1"
	$(GPU_BIN)/python -m pip install --quiet $(PIP_FROM) --no-build-isolation \
		-c $(GPU_VENV)/constraints.txt -e ".[gpu]"
	$(GPU_BIN)/python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" | cmp -s - $(GPU_VENV)/constraints.txt \
		|| { echo "torch changed in $(GPU_VENV)"; exit 1; }
	@touch $@

gpu-check: gpu-setup
	$(GPU_BIN)/python -m course_lib.bench.gpucheck $(GPU_CHECK_ARGS)

lab: setup
	$(BIN)/jupyter lab labs/

labs: setup
	$(BIN)/python -m course_lib.grading.labgen solutions labs

# FULL=1: every cell of every notebook, with its outputs (default: only what the checks need)
grade: setup sandbox
	$(BIN)/python -m course_lib.grading.gradebook $(SUBMISSIONS) --out $(GRADEBOOK) \
	  --timeout $(GRADE_TIMEOUT) --jobs $(JOBS) $(if $(filter 1,$(FULL)),--full)

bench: setup
	$(BIN)/python -m course_lib.bench collectives --nproc $(NPROC) --sizes 4K:64M

clean:
	rm -rf $(VENV) runs .pytest_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
