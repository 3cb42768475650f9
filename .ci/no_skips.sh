#!/bin/sh
# Fails when a ctest run left a test unrun (skipped, disabled), naming each
# with ctest's reason and the test's own skip message. CI runs it after
# `make test` (SHARDTRAIN_CI=1): the CI machine has everything every test
# needs (root, OpenBLAS, Chromium), so a skip there means a test silently
# stopped running.
#   no_skips.sh JUNIT_XML   (from ctest --output-junit)
set -eu
junit=$1
if [ ! -s "$junit" ]; then
  echo "no_skips.sh: $junit is missing or empty; run ctest with --output-junit $junit" >&2
  exit 1
fi
# ctest writes one <testcase ... status="..."> line per test; a test that did
# not run has status "notrun" (a <skipped message="..."/> line gives ctest's
# reason: SKIP_RETURN_CODE=77, SKIP_REGULAR_EXPRESSION_MATCHED) or
# "disabled". Its output, in <system-out>, holds the skip message: gtest's
# "FILE:LINE: Skipped" and the line after it, or a script's "SKIP: ..." line.
unrun=$(awk '
  function unescape(s) {
    gsub(/&lt;/, "<", s); gsub(/&gt;/, ">", s); gsub(/&quot;/, "\"", s); gsub(/&amp;/, "\\&", s)
    return s
  }
  function attr(line, key) {
    if (!match(line, " " key "=\"[^\"]*\"")) return ""
    return unescape(substr(line, RSTART + length(key) + 3, RLENGTH - length(key) - 4))
  }
  /<testcase / {
    status = attr($0, "status")
    flagged = status == "notrun" || status == "disabled"
    if (flagged) print "  " attr($0, "name") " (" status ")"
    after_skipped = 0
    split("", seen)
    next
  }
  !flagged { next }
  /<skipped / { print "    ctest: " attr($0, "message"); next }
  {
    line = unescape($0)
    sub(/.*<system-out>/, "", line)
    sub(/<\/system-out>.*/, "", line)
    sub(/^\[rank [0-9]+\] /, "", line)  # every rank of a launched test says the same
    if ((after_skipped || line ~ /SKIP:/) && !(line in seen)) {
      print "    " line
      seen[line] = 1
    }
    after_skipped = line ~ /: Skipped$/
  }
  /<\/testcase>/ { flagged = 0 }
' "$junit")
if [ -n "$unrun" ]; then
  echo "FAILED under CI: tests that did not run:" >&2
  printf '%s\n' "$unrun" >&2
  echo "Every test must run on the CI machine: install what the skip message asks for, or leave the test out of that registration (tests/CMakeLists.txt, \"skips\")." >&2
  exit 1
fi
echo "no_skips.sh: every test ran"
