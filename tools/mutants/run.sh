#!/usr/bin/env bash
# The mutation check behind `make mutants` (docs/testing.md). Each
# tools/mutants/NN-name.patch plants one deliberate bug and names, in its
# header, the ctest tests that must catch it:
#
#   Plants: <what the bug is, one line>
#   Tests: <ctest regex>
#
# The bugs are planted one at a time in a copy of the source tree (never in
# the tree itself, which someone may be editing), the copy is rebuilt
# incrementally and the named tests run. A mutant is killed when one of them
# fails or times out, survived when all pass (a hole in the suite), and an
# error when its patch does not apply or build, or names no test.
#
# Environment:
#   BUILD_DIR     where the copy lives, under BUILD_DIR/mutants (default build)
#   MUTANTS       comma-separated subset: full names, names without the
#                 number, or numbers (default: every patch)
#   JOBS          ninja and ctest parallelism (default: nproc)
#   TEST_TIMEOUT  seconds per test without a TIMEOUT of its own (default 900)
#   BASELINE=1    first run every named test on the unmutated copy and stop
#                 if one fails there (it would "kill" every mutant)
#   SYNC=0        use the copy as it is, without syncing it with the tree
#                 (say, while the tree is in the middle of an edit)
# Exit status: 0 when every mutant was killed, 1 otherwise, 2 when the check
# itself could not run.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
cd "$root"
work=$(realpath -m "${BUILD_DIR:-build}")/mutants
src=$work/src   # the copy of the tree
bld=$work/build # its build directory
jobs=${JOBS:-$(nproc)}
# ccache caches compiles that use the precompiled header only with this
# sloppiness: a mutant's restored file then comes from the cache, and so
# does the mutated one on a later run of the same patch.
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros}
timeout=${TEST_TIMEOUT:-900}

die() { echo "mutants: $*" >&2; exit 2; }

mkdir -p "$work/logs" "$src"
exec 9>"$work/lock"
flock -n 9 || die "another run is using $work"

# ---- the copy ------------------------------------------------------------------
# Tracked files and untracked ones git does not ignore, so work not yet
# committed is checked too. Only files whose content differs are copied, with
# a fresh mtime: ninja then rebuilds exactly those. (Keeping the tree's mtime
# instead could leave a file that changed before the copy's last build looking
# older than its object file.)
sync_tree() {
  git ls-files -z --cached --others --exclude-standard | LC_ALL=C sort -z > "$work/listed"
  while IFS= read -r -d '' f; do
    [[ -f $f ]] || continue  # deleted in the working tree, not yet in the index
    if ! cmp -s "$f" "$src/$f"; then
      mkdir -p "$src/$(dirname "$f")"
      cp --preserve=mode "$f" "$src/$f"
    fi
  done < "$work/listed"
  # What the tree no longer has goes too (the build globs src/*/*.cpp).
  (cd "$src" && find . -type f -printf '%P\0' | LC_ALL=C sort -z) > "$work/copied"
  LC_ALL=C comm -z -13 "$work/listed" "$work/copied" | (cd "$src" && xargs -0 -r rm -f)
  # What the copy holds, for the table.
  echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' plus uncommitted changes')" \
       "(synced $(date -u '+%Y-%m-%d %H:%M UTC'))" > "$work/synced"
}

# ---- the mutants ----------------------------------------------------------------
header() { sed -n "s/^$1: *//p" "$2" | head -n 1; }

selected=()
for p in "$here"/[0-9]*.patch; do
  name=$(basename "$p" .patch)
  if [[ -z ${MUTANTS:-} || ",$MUTANTS," == *",$name,"* || ",$MUTANTS," == *",${name#*-},"* ||
        ",$MUTANTS," == *",${name%%-*},"* ]]; then
    selected+=("$p")
  fi
done
(( ${#selected[@]} > 0 )) || die "no mutant matches MUTANTS='${MUTANTS:-}'"
for p in "${selected[@]}"; do
  [[ -n $(header Plants "$p") && -n $(header Tests "$p") ]] ||
    die "$(basename "$p") lacks a 'Plants:' or 'Tests:' header line"
done

# Files a patch touches (its +++ lines), kept aside so they can be put back.
touched() { sed -n 's|^+++ b/\([^[:space:]]*\).*|\1|p' "$1"; }
current=""
restore() {
  [[ -n $current ]] || return 0
  local f
  for f in $(touched "$current"); do
    if [[ -f $work/orig/$f ]]; then
      cp --preserve=mode "$work/orig/$f" "$src/$f"  # fresh mtime: rebuilt next time
    else
      rm -f "$src/$f"  # the patch created it
    fi
  done
  current=""
}
trap restore EXIT
trap 'exit 130' INT TERM

# Tests of a ctest log that failed or timed out, for the result column
# ("Not Run" ones, a missing executable or a failed fixture, are left out).
failed_tests() {
  sed -n '/The following tests FAILED:/,$s/^[[:space:]]*[0-9]* - \([^ ]*\) .*/\1 &/p' "$1" |
    grep -v '(Not Run)$' | cut -d ' ' -f 1 || true
}

# ---- run ----------------------------------------------------------------------------
started=$SECONDS
if [[ ${SYNC:-1} == 0 && -f $work/synced ]]; then
  echo "mutants: using the copy in $src as last synced (SYNC=0)"
else
  echo "mutants: syncing the copy in $src"
  sync_tree
fi
# Executables are not relinked when only libshardtrain.so changed (they load
# it at run time): a mutant of the library then rebuilds one object and the
# library, not every test executable as well. One source file per
# translation unit (no unity build): each mutant recompiles its own file, not
# the seven others batched with it; only the first build pays for that.
if [[ ! -f $bld/build.ninja ]] ||
   ! grep -q '^CMAKE_LINK_DEPENDS_NO_SHARED:[A-Z]*=ON$' "$bld/CMakeCache.txt" 2>/dev/null ||
   ! grep -q '^CMAKE_UNITY_BUILD:[A-Z]*=OFF$' "$bld/CMakeCache.txt" 2>/dev/null; then
  cmake -S "$src" -B "$bld" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_LINK_DEPENDS_NO_SHARED=ON \
    -DCMAKE_UNITY_BUILD=OFF \
    > "$work/logs/configure.log" 2>&1 ||
    die "configuring the copy failed; see $work/logs/configure.log"
fi
echo "mutants: building the unmutated copy (ninja -j $jobs)"
ninja -C "$bld" -j "$jobs" > "$work/logs/baseline-build.log" 2>&1 ||
  die "the unmutated copy does not build; see $work/logs/baseline-build.log"

if [[ ${BASELINE:-0} == 1 ]]; then
  all=$(for p in "${selected[@]}"; do header Tests "$p"; done | paste -sd '|')
  echo "mutants: running the named tests unmutated"
  (cd "$bld" && ctest -R "$all" --timeout "$timeout" -j "$jobs" --output-on-failure) \
    > "$work/logs/baseline-tests.log" 2>&1 ||
    die "named tests fail without any mutant: $(failed_tests "$work/logs/baseline-tests.log" | paste -sd ' ')"
fi

rows=()
bad=0
for p in "${selected[@]}"; do
  name=$(basename "$p" .patch)
  tests=$(header Tests "$p")
  log=$work/logs/$name.log
  t0=$SECONDS
  echo "mutants: $name"
  rm -rf "$work/orig"
  for f in $(touched "$p"); do
    if [[ -f $src/$f ]]; then
      mkdir -p "$(dirname "$work/orig/$f")"
      cp --preserve=mode "$src/$f" "$work/orig/$f"
    fi
  done
  current=$p
  # The test list is the unmutated build's: counted before anything is rebuilt.
  count=$(cd "$bld" && ctest -N -R "$tests" | sed -n 's/^Total Tests: //p')
  : > "$log"
  if [[ ${count:-0} == 0 ]]; then
    result="error: no test matches"
  elif ! patch -d "$src" -p1 --forward --no-backup-if-mismatch -r - < "$p" >> "$log" 2>&1; then
    result="error: does not apply"
  elif ! ninja -C "$bld" -j "$jobs" >> "$log" 2>&1; then
    result="error: does not build"
  elif (cd "$bld" && ctest -R "$tests" --timeout "$timeout" -j "$jobs" --output-on-failure) >> "$log" 2>&1; then
    result="survived"
  else
    caught=$(failed_tests "$log")
    n=$(grep -c . <<< "$caught" || true)
    if (( n == 0 )); then
      result="error: no test failed, but some did not run"
    else
      result="killed: $(head -n 2 <<< "$caught" | paste -sd ' ')"
      (( n <= 2 )) || result+=" +$((n - 2)) more"
    fi
  fi
  restore
  [[ $result == killed* ]] || bad=1
  rows+=("| $name | $(header Plants "$p") | \`${tests//|/\\|}\` ($count) | $result | $((SECONDS - t0)) |")
  echo "mutants: $name: $result ($((SECONDS - t0)) s; log: $log)"
done

# ---- the table ------------------------------------------------------------------------
command="${MUTANTS:+MUTANTS=$MUTANTS }${BASELINE:+BASELINE=$BASELINE }${SYNC:+SYNC=$SYNC }JOBS=$jobs bash tools/mutants/run.sh"
{
  echo "\`$command\` on $(cat "$work/synced" 2>/dev/null || echo 'an unknown tree'), finished $(date -u '+%Y-%m-%d %H:%M UTC'), $((SECONDS - started)) s in all:"
  echo
  echo "| mutant | plants | tests (count) | result | s |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} > "$work/last.md"
echo
cat "$work/last.md"
echo
echo "mutants: table written to $work/last.md"
exit "$bad"
