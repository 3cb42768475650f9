#!/usr/bin/env bash
# The run report in a real browser: two tiny runs (2-rank DDP), the report
# `shardtrain train` writes at the end of each, and one overlaying both from
# `shardtrain report`; headless Chromium renders the page. It must log
# nothing to the console, its DOM must hold the ten charts with lines, and
# the screenshot must show both runs' colours in quantity (the charts were
# drawn, not just a blank or text-only page). Then a pipeline run's report
# draws the timeline of a step.
#   report_browser.sh SHARDTRAIN_CLI SOURCE_DIR
# KEEP_SCREENSHOT=FILE.png keeps the screenshot (docs/report.png comes from
# here). Exits 77 (skipped) when Chromium is not installed.
set -euo pipefail
cli=$1 src=$2
browser=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$browser" ]; then echo "SKIP: no chromium (make deps installs it)"; exit 77; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

common=(--set data.train="$src/data/corpus.txt" --set trainer.progress=plain
  --set trainer.sample_tokens=0 --set model.n_layer=1 --set model.n_head=2 --set model.n_embd=32
  --set model.block_size=32 --set batch.global=8 --set batch.micro=4 --set batch.accumulate=null
  --set distributed.threads_per_rank=1 --set trainer.max_steps=24 --set trainer.eval_every=6
  --set trainer.eval_batches=2 --set schedule.warmup_steps=4 --set distributed.strategy=ddp)
for lr in 3e-3 1e-3; do
  "$cli" train "$src/configs/default.yaml" "${common[@]}" --nproc-per-node 2 \
    --set optimizer.lr=$lr --set run.dir="$work/lr-$lr" > "$work/train-$lr.log" 2>&1 ||
    { cat "$work/train-$lr.log"; fail "training with lr $lr"; }
  [ -s "$work/lr-$lr/report.html" ] || fail "shardtrain train wrote no report.html"
done
"$cli" report "$work/lr-3e-3" "$work/lr-1e-3" --out "$work/both.html" || fail "shardtrain report"

# The page as the browser built it, and everything Chromium logged.
run_browser() {
  timeout 120 "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --enable-logging=stderr --v=0 "$@" "file://$work/both.html"
}
run_browser --dump-dom > "$work/dom.html" 2> "$work/dom.log" || { cat "$work/dom.log"; fail "chromium --dump-dom"; }
run_browser --screenshot="$work/report.png" --window-size=1200,1900 > /dev/null 2> "$work/shot.log" ||
  { cat "$work/shot.log"; fail "chromium --screenshot"; }
if grep -h ":CONSOLE" "$work/dom.log" "$work/shot.log"; then fail "the page logged to the console"; fi

python3 - "$work/dom.html" "$work/report.png" <<'PY'
import re, struct, sys, zlib
dom = open(sys.argv[1]).read()
charts = re.findall(r'<figure class="chart" id="chart-([a-z_]+)"', dom)
want = ["loss", "lr", "grad_norm", "loss_scale", "skipped", "tokens_per_s", "peak_rss_mb", "compute_s", "shares",
        "comm_hidden"]
assert charts == want, f"charts in the DOM: {charts}"
for key in want:
    fig = dom.split(f'id="chart-{key}"')[1].split("</figure>")[0]
    assert fig.count('<path class="series"') >= 2, f"chart {key} has fewer than two lines"
assert "lr-3e-3" in dom and "lr-1e-3" in dom, "legend without both runs"

# A PNG decoder (stdlib only): 8-bit RGB or RGBA, every scanline filter.
data = open(sys.argv[2], "rb").read()
assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
pos, idat = 8, b""
while pos < len(data):
    n, kind = struct.unpack(">I4s", data[pos:pos + 8])
    body = data[pos + 8:pos + 8 + n]
    if kind == b"IHDR":
        w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
    elif kind == b"IDAT":
        idat += body
    pos += 12 + n
assert depth == 8 and ctype in (2, 6), f"unexpected PNG format depth {depth} colour type {ctype}"
bpp = 3 if ctype == 2 else 4
raw, stride = zlib.decompress(idat), w * bpp
prev, rows, at = bytearray(stride), [], 0
for _ in range(h):
    f, line = raw[at], bytearray(raw[at + 1:at + 1 + stride])
    at += 1 + stride
    for i in range(stride):
        a = line[i - bpp] if i >= bpp else 0
        b, c = prev[i], prev[i - bpp] if i >= bpp else 0
        if f == 1: line[i] = (line[i] + a) & 255
        elif f == 2: line[i] = (line[i] + b) & 255
        elif f == 3: line[i] = (line[i] + (a + b) // 2) & 255
        elif f == 4:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    rows.append(line)
    prev = line
def near(px, rgb):
    return sum(abs(px[k] - rgb[k]) for k in range(3)) < 60
blue, red = (0x1f, 0x77, 0xb4), (0xd6, 0x27, 0x28)
counts = {"blue": 0, "red": 0, "other": 0}
colours = set()
for line in rows:
    for x in range(0, stride, bpp):
        px = line[x:x + 3]
        colours.add(bytes(px))
        if near(px, blue): counts["blue"] += 1
        elif near(px, red): counts["red"] += 1
        elif px != b"\xff\xff\xff": counts["other"] += 1
print(f"screenshot {w}x{h}: {len(colours)} colours, pixels {counts}")
assert len(colours) > 50, "the screenshot is (nearly) blank"
# Lines across the visible charts: thousands of pixels of each run's colour.
assert counts["blue"] > 1500 and counts["red"] > 1500, "the runs' lines are not drawn"
PY
if [ -n "${KEEP_SCREENSHOT:-}" ]; then cp "$work/report.png" "$KEEP_SCREENSHOT"; fi

# A pipeline run (2 stages, zero_bubble, 4 micro-batches a step): its report
# draws the last logged step's work, a row per rank and a box per piece of
# work: 4 forwards, 4 input halves and 4 weight halves on each rank.
"$cli" train "$src/configs/default.yaml" "${common[@]}" --nproc-per-node 2 --set batch.micro=2 \
  --set trainer.max_steps=4 --set distributed.pipeline_parallel=2 --set distributed.pipeline_schedule=zero_bubble \
  --set run.dir="$work/pipe" > "$work/train-pipe.log" 2>&1 || { cat "$work/train-pipe.log"; fail "training pp2"; }
timeout 120 "$browser" --headless --no-sandbox --disable-gpu --enable-logging=stderr --v=0 --dump-dom \
  "file://$work/pipe/report.html" > "$work/pipe-dom.html" 2> "$work/pipe-dom.log" ||
  { cat "$work/pipe-dom.log"; fail "chromium --dump-dom (pipeline)"; }
if grep -h ":CONSOLE" "$work/pipe-dom.log"; then fail "the pipeline page logged to the console"; fi
python3 - "$work/pipe-dom.html" <<'PY'
import re, sys
dom = open(sys.argv[1]).read()
assert "<h2>Pipeline timeline</h2>" in dom, "no pipeline timeline"
svg = dom.split('class="timeline"')[1].split("</svg>")[0]
rows = re.findall(r">rank (\d+)<", svg)
assert rows == ["0", "1"], f"timeline rows {rows}"
kinds = re.findall(r'<rect class="work" data-kind="([FBIW])"', svg)
assert sorted(kinds) == sorted(["F"] * 8 + ["I"] * 8 + ["W"] * 8), f"boxes {sorted(kinds)}"
print(f"pipeline timeline: 2 rows, {len(kinds)} boxes (F, I, W x 4 micro-batches x 2 ranks)")
PY
echo "report in the browser OK"
