#!/bin/sh
# Fails when a ctest run left a test unrun (skipped, disabled), naming each
# with ctest's reason. CI runs it after `make test` (SHARDTRAIN_CI=1): the CI
# machine has everything every test needs (root, OpenBLAS, Chromium), so a
# skip there means a test silently stopped running.
#   no_skips.sh JUNIT_XML   (from ctest --output-junit)
set -eu
junit=$1
if [ ! -s "$junit" ]; then
  echo "no_skips.sh: $junit is missing or empty; run ctest with --output-junit $junit" >&2
  exit 1
fi
# ctest writes one <testcase ... status="..."> line per test, a test that did
# not run with status "notrun" (a <skipped message="..."/> line gives the
# reason: SKIP_RETURN_CODE=77, SKIP_REGULAR_EXPRESSION_MATCHED) or "disabled".
unrun=$(awk '
  function attr(line, key,   rest) {
    if (!match(line, key "=\"[^\"]*\"")) return ""
    rest = substr(line, RSTART + length(key) + 2, RLENGTH - length(key) - 3)
    gsub(/&lt;/, "<", rest); gsub(/&gt;/, ">", rest); gsub(/&quot;/, "\"", rest); gsub(/&amp;/, "\\&", rest)
    return rest
  }
  /<testcase / {
    if (name != "") print "  " name " (" why ")"
    name = ""
    status = attr($0, "status")
    if (status == "notrun" || status == "disabled") { name = attr($0, "name"); why = status }
    next
  }
  /<skipped / && name != "" { why = attr($0, "message") }
  END { if (name != "") print "  " name " (" why ")" }
' "$junit")
if [ -n "$unrun" ]; then
  count=$(printf '%s\n' "$unrun" | wc -l)
  echo "FAILED under CI: $count test(s) did not run:" >&2
  printf '%s\n' "$unrun" >&2
  echo "Every test must run on the CI machine: install what the test's skip message asks for, or leave the test out of that registration (see tests/CMakeLists.txt, \"skips\")." >&2
  exit 1
fi
echo "no_skips.sh: every test ran"
