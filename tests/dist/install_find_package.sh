#!/usr/bin/env bash
# `make install` gives a CMake package: install into a scratch prefix, then
# configure the examples as an outside project with find_package(shardtrain)
# and build one of them.
set -euo pipefail
build=$1 src=$2
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix/usr" > /dev/null
test -f "$prefix/usr/include/shardtrain/comm/communicator.h"
test -f "$prefix/usr/lib/cmake/shardtrain/shardtrainConfig.cmake" || test -f "$prefix"/usr/lib/*/cmake/shardtrain/shardtrainConfig.cmake
cmake -S "$src/examples" -B "$prefix/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$prefix/usr" > "$prefix/configure.log" || { cat "$prefix/configure.log"; exit 1; }
cmake --build "$prefix/build" --target manual_loop -j 2 > "$prefix/build.log" || { cat "$prefix/build.log"; exit 1; }
LD_LIBRARY_PATH="$prefix/usr/lib:$(ls -d "$prefix"/usr/lib/*/ 2>/dev/null | tr '\n' ':')" \
  "$build/shardtrain" launch --nproc-per-node 1 -- "$prefix/build/manual_loop"
# The installed binary runs its default job from any directory: built-in
# defaults, and the corpus from PREFIX/share/shardtrain.
test -f "$prefix/usr/share/shardtrain/configs/default.yaml"
test -f "$prefix/usr/share/shardtrain/configs/finetune-lora.yaml"
test -f "$prefix/usr/share/shardtrain/data/corpus.txt"
mkdir "$prefix/elsewhere"
out=$(cd "$prefix/elsewhere" && LD_LIBRARY_PATH="$prefix/usr/lib:$(ls -d "$prefix"/usr/lib/*/ 2>/dev/null | tr '\n' ':')" \
  "$prefix/usr/bin/shardtrain" train --set distributed.strategy=single --set trainer.max_steps=2 \
  --set trainer.eval_every=0 --set trainer.sample_tokens=8 --set model.n_layer=1 2>&1) || { echo "$out"; exit 1; }
echo "$out"
grep -q "config: none given; the built-in defaults" <<<"$out"
grep -q "using $prefix/usr/share/shardtrain/data/corpus.txt" <<<"$out"
test -f "$prefix/elsewhere/runs/default/model.safetensors"
echo "find_package(shardtrain) works; the installed binary trains from any directory"
