#!/usr/bin/env bash
# A person watching: `shardtrain train` with 2 ranks in a real terminal (a
# tmux pane) draws one progress bar that updates in place, with the
# evaluation and end-of-run lines scrolled above it: a 60-step run leaves one
# bar line on the screen, not 60 step lines. Through a pipe, the same run
# prints its 60 plain step lines and no progress protocol.
set -euo pipefail
cli=$1 src=$2
tmp=$(mktemp -d)
sock="shardtrain-test-$$"
trap 'tmux -L "$sock" kill-server 2>/dev/null || true; rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

args=(train configs/default.yaml --nproc-per-node 2
      --set trainer.max_steps=60 --set trainer.eval_every=20 --set trainer.eval_batches=1
      --set trainer.sample_tokens=0 --set model.n_layer=1 --set model.n_head=2 --set model.n_embd=32
      --set model.block_size=32 --set batch.global=4 --set batch.micro=2 --set batch.accumulate=null
      --set distributed.threads_per_rank=1)

# In a terminal: 200 columns, a history long enough for everything printed.
tmux -L "$sock" new-session -d -x 200 -y 50 \
  "cd '$src' && '$cli' ${args[*]} --set run.dir='$tmp/tty'; echo \$? > '$tmp/code'; sleep 600"
for _ in $(seq 1 600); do [ -s "$tmp/code" ] && break; sleep 0.5; done
[ -s "$tmp/code" ] || fail "the run in the terminal did not finish within 300 s"
screen=$(tmux -L "$sock" capture-pane -p -S - -E -)
echo "---- screen ----"; echo "$screen"; echo "----------------"
[ "$(cat "$tmp/code")" = 0 ] || fail "the run in the terminal exited $(cat "$tmp/code")"
bars=$(grep -c '^\[[#.]\{24\}\]' <<<"$screen" || true)
[ "$bars" -eq 1 ] || fail "expected exactly one bar line on the screen, found $bars"
grep -q '^\[#\{24\}\] 60/60 100% | loss [0-9.]* | [0-9]* tok/s | eta ' <<<"$screen" ||
  fail "the bar does not end at 60/60 with loss, tokens/s and eta"
grep -q 'slowest: rank [01] at 60' <<<"$screen" || fail "the bar does not name the slowest rank"
steps=$(grep -c 'step [0-9]*/60 |' <<<"$screen" || true)
[ "$steps" -eq 0 ] || fail "$steps per-step lines scrolled in the terminal"
evals=$(grep -c '^\[rank 0\] step [0-9]* | eval_loss' <<<"$screen" || true)
[ "$evals" -eq 3 ] || fail "expected the 3 evaluation lines above the bar, found $evals"
grep -q '^\[rank 0\] trained 60 steps in' <<<"$screen" || fail "no end-of-run line"
! grep -q '@shardtrain-progress' <<<"$screen" || fail "the progress protocol leaked to the screen"
# The bar is the last thing drawn: the end-of-run lines scrolled above it.
last=$(grep -v '^$' <<<"$screen" | tail -1)
[[ "$last" == \[#* ]] || fail "the last line on the screen is not the bar: $last"

# Through a pipe: plain lines, one per step, from rank 0 only.
(cd "$src" && "$cli" "${args[@]}" --set run.dir="$tmp/pipe") > "$tmp/pipe.out" 2>&1 ||
  { cat "$tmp/pipe.out"; fail "the piped run failed"; }
plain=$(grep -c '^\[rank 0\] step [0-9]*/60 |' "$tmp/pipe.out" || true)
[ "$plain" -eq 60 ] || fail "expected 60 plain step lines through a pipe, got $plain"
! grep -q '@shardtrain-progress' "$tmp/pipe.out" || fail "progress protocol lines through a pipe"
echo "progress OK: one bar in the terminal, $plain plain lines through a pipe"
