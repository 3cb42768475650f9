#!/usr/bin/env bash
# The run directory stays locked between restart rounds (issue 47, "Tests
# from outside, third pass"). `shardtrain train --max-restarts 1` trains one
# rank; after its first checkpoint the rank is SIGKILLed and the launcher
# starts it again. Meanwhile a second process tries, every 0.1 ms, to
# take the run directory's lock file the way another job would (flock(2),
# exclusive, non-blocking, on RUN_DIR/.shardtrain.lock). It must never get it
# while the job lives, through the kill and the relaunch; once the job has
# ended it must get it at once (so the probe is known to work).
set -euo pipefail
cli=$1 src=$2
cd "$src"
work=$(mktemp -d)
probe=
trap '[ -n "$probe" ] && kill "$probe" 2>/dev/null; rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$cli" train --nproc-per-node 1 --max-restarts 1 \
  --set trainer.max_steps=60 --set trainer.eval_every=0 --set trainer.sample_tokens=0 \
  --set trainer.progress=none --set batch.global=2 --set batch.micro=2 --set batch.accumulate=null \
  --set model.n_layer=1 --set model.n_head=2 --set model.n_embd=32 --set model.block_size=32 \
  --set checkpoint.every_n_steps=2 --set distributed.strategy=ddp \
  --set distributed.threads_per_rank=1 --set run.dir="$work/run" >"$work/job.log" 2>&1 &
job=$!
until [ -f "$work/run/.shardtrain.lock" ]; do
  kill -0 "$job" 2>/dev/null || { cat "$work/job.log"; fail "the job ended before it locked its run directory"; }
  sleep 0.01
done

# The probe prints the time of each success (the lock is let go at once, so
# a job that re-takes it is not kept out by the probe). The job lets its lock
# go as it ends, after its last write: a success counts when it came before
# the job's last write in the run directory (it was free while the job still
# worked).
python3 - "$work/run/.shardtrain.lock" "$work/stop" "$job" >"$work/probe.log" 2>&1 <<'EOF' &
import fcntl, os, sys, time
lock, stop, job = sys.argv[1], sys.argv[2], sys.argv[3]
def running():
    try:
        with open("/proc/%s/stat" % job) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
tries = 0
while not os.path.exists(stop) and running():
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print("taken at", time.time(), flush=True)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        pass
    os.close(fd)
    tries += 1
    time.sleep(0.0001)
print("tries", tries, flush=True)
EOF
probe=$!

# The first checkpoint, then the rank (the launcher's child that is not its
# fork server) is killed.
until compgen -G "$work/run/checkpoints/step-*/COMMITTED" >/dev/null; do
  kill -0 "$job" 2>/dev/null || { cat "$work/job.log"; fail "the job ended before its first checkpoint"; }
  sleep 0.02
done
rank=
for _ in $(seq 200); do
  # The launcher's children but its fork server (src/launch/fork_server.h).
  ranks=($(pgrep -P "$job" -x shardtrain || true))
  [ "${#ranks[@]}" = 1 ] && rank=${ranks[0]} && break
  sleep 0.02
done
[ -n "$rank" ] || { cat "$work/job.log"; fail "did not find the job's rank"; }
echo "SIGKILL to rank pid $rank"
kill -9 "$rank"
rc=0
wait "$job" || rc=$?
touch "$work/stop"
wait "$probe" || true
probe=
[ "$rc" = 0 ] || { cat "$work/job.log"; fail "the job exited $rc"; }
grep -q "after restart 1" "$work/job.log" || { cat "$work/job.log"; fail "the rank was not restarted"; }
tries=$(sed -n 's/^tries \([0-9]*\)/\1/p' "$work/probe.log")
[ "${tries:-0}" -ge 100 ] || { cat "$work/probe.log"; fail "the probe ran only ${tries:-0} times"; }
last_write=$(find "$work/run" -type f ! -name .shardtrain.lock -printf '%T@\n' | sort -n | tail -n 1)
early=$(awk -v last="$last_write" '/^taken at/ && $3 < last { n++ } END { print n + 0 }' "$work/probe.log")
if [ "$early" != 0 ]; then
  cat "$work/job.log"
  echo "last write in the run directory at $last_write"
  grep "^taken" "$work/probe.log" | head -n 5
  fail "another process took the run directory's lock $early times while the job still worked (around its restart)"
fi
python3 -c 'import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)' \
  "$work/run/.shardtrain.lock" || fail "the lock is still held after the job ended: the probe cannot tell"
echo "run-directory lock OK: held through the kill and the restart ($tries tries by another process)"
