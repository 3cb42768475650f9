# The whole set-up: `make test` and `make train` install what is missing
# (Debian packages, as root), configure, build and run. Everything else here
# is a step of those two.

BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release
# Every translation unit uses the precompiled <torch/torch.h>; ccache caches
# such a compile only with this sloppiness (without it every call is
# "uncacheable"). Measured: a library file 12.4 s compiled, 3.4 s cached.
export CCACHE_SLOPPINESS ?= pch_defines,time_macros

# What the build and the tests need from Debian. libopenblas0-pthread replaces
# the reference BLAS behind LibTorch's GEMMs (about 5 -> 90 GFLOP/s here).
# protobuf writes TensorBoard event files; chromium renders the run report
# in the browser test; python3-torch runs the independent model references
# (tests/reference) that the model-family tests compare against. Open MPI is
# the mpi communication backend (and mpirun starts the suite's MPI runs);
# CLI11 (header-only) parses the tool's flags, not used by the library.
DEB_PACKAGES := build-essential cmake ninja-build ccache pkg-config \
	libtorch-dev libgloo-dev libyaml-cpp-dev libgtest-dev libopenblas0-pthread \
	nlohmann-json3-dev iproute2 libssl-dev tmux \
	libprotobuf-dev protobuf-compiler chromium \
	libpcre2-dev libutf8proc-dev libsentencepiece-dev python3-torch \
	libopenmpi-dev openmpi-bin libcli11-dev
# Node runs the tokenizer parity test's independent implementation (npm
# packages installed into the build tree at test time). Installed only when
# npm is missing: NodeSource's nodejs, where present, ships npm and conflicts
# with Debian's npm package.
NODE_PACKAGES := nodejs npm

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all deps bench-deps configure build test mutants train bench-comm bench-train bench-sharding bench-tp bench-pipeline bench-balance bench-multinode bench-scale bench-precision bench-checkpoint bench-lora bench-tokenize bench-llama bench-finetune bench-loading bench-first-step install clean

all: build

# Installs only what dpkg does not already report as installed.
define apt_install
	@missing=""; for p in $(1); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi
endef

deps:
	$(call apt_install,$(DEB_PACKAGES))
	@if ! command -v npm >/dev/null 2>&1; then \
	  echo "installing: $(NODE_PACKAGES)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $(NODE_PACKAGES); \
	fi

# The benchmarks' peer, Debian's PyTorch, is a test dependency already.
bench-deps: deps

$(BUILD_DIR)/build.ninja: | deps
	cmake -S . -B $(BUILD_DIR) -G Ninja $(CMAKE_FLAGS)

configure: deps $(BUILD_DIR)/build.ninja

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# Under CI (SHARDTRAIN_CI=1, set by .ci/run) a test that did not run fails
# the run too, by name: a skip there means a test silently stopped running.
test: build
ifdef SHARDTRAIN_CI
	cd $(BUILD_DIR) && rm -f ctest-junit.xml && ctest --output-on-failure -j $(JOBS) --output-junit ctest-junit.xml
	sh .ci/no_skips.sh $(BUILD_DIR)/ctest-junit.xml
else
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)
endif

# The mutation check (docs/testing.md): each deliberate bug of tools/mutants/
# is planted in a copy of the tree under $(BUILD_DIR)/mutants and must be
# caught by the tests its patch names. 30 to 80 s per mutant once the copy
# is built (about 25 minutes for all at JOBS=2), so not part of `test`;
# MUTANTS=name,... runs a subset.
mutants: build
	BUILD_DIR=$(BUILD_DIR) JOBS=$(JOBS) bash tools/mutants/run.sh

# The default job: configs/default.yaml on this machine's cores (one rank per
# core); it prints a text sample and the run directory at the end.
train: build
	$(BUILD_DIR)/shardtrain train configs/default.yaml

# One host at 2 and 4 ranks, then two network-namespace hosts (needs root;
# TWO_HOSTS=0 skips them); about 4 minutes.
bench-comm: build bench-deps
	bash bench/comm.sh

# About 9 minutes on 2 idle cores; QUICK=1 is a smoke test of the script
# (its figures are not for BENCHMARKS.md), MODELS=gpt-25m narrows it.
bench-train: build bench-deps
	BUILD_DIR=$(BUILD_DIR) bash bench/train.sh

bench-sharding: build bench-deps
	bash bench/sharding.sh

# Tensor parallelism x2 (with and without sequence parallelism) against DDP
# x2 and FULL_SHARD x2 on one host: tokens/s, peak RSS, TP collective time.
bench-tp: build bench-deps
	BUILD_DIR=$(BUILD_DIR) /usr/bin/python3 bench/tp.py

# Pipeline parallelism: the bubble on one host, and pp across two
# network-namespace hosts over a shaped link (needs root).
bench-pipeline: build
	bash bench/pipeline.sh

# Measured load balancing: one rank throttled by a cgroup, and none (needs root).
bench-balance: build
	BUILD_DIR=$(BUILD_DIR) /usr/bin/python3 bench/balance.py

# Two network-namespace hosts over a shaped link (needs root).
bench-multinode: build
	bash bench/multinode.sh

# 64 ranks over 8 network-namespace hosts, a tiny model (needs root, ~12 GB).
bench-scale: build
	bash bench/scale.sh

bench-precision: build
	bash bench/precision.sh

bench-checkpoint: build
	BUILD_DIR=$(BUILD_DIR) bash bench/checkpoint.sh

bench-lora: build
	bash bench/lora.sh

# shardtrain tokenize against @lenml/tokenizers (Node, npm packages in
# build/npm) on 20 MB of the bundled corpus; a few minutes, mostly the JS side.
bench-tokenize: build
	bash bench/tokenize.sh

bench-finetune: build bench-deps
	bash bench/finetune.sh

# Loading a Hugging Face directory under FULL_SHARD on 2 ranks: time against
# reading the files once, peak RSS against training's (a 0.7 GB model).
bench-loading: build
	BUILD_DIR=$(BUILD_DIR) bash bench/loading.sh

bench-llama: build bench-deps
	BUILD_DIR=$(BUILD_DIR) MODELS=llama-25m SECTION=train-llama bash bench/train.sh

# Time to the first step against PyTorch's (process start, library load,
# rendezvous, model build, data, first step); into BENCHMARKS.md.
bench-first-step: build bench-deps
	BUILD_DIR=$(BUILD_DIR) python3 bench/first_step.py

install: build
	cmake --install $(BUILD_DIR)

clean:
	rm -rf $(BUILD_DIR)
