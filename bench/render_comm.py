#!/usr/bin/env python3
"""Renders bench/comm.sh's JSON lines into BENCHMARKS.md (stdlib only).

Replaces the text between <!-- comm:begin --> and <!-- comm:end --> in --out,
appends the section when the markers are missing, and creates the file (with a
short header) when it does not exist. Text outside the markers is kept.
"""
import argparse
import sys

import benchlib

BEGIN, END = "<!-- comm:begin -->", "<!-- comm:end -->"
SUP = "¹²³⁴⁵"
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "barrier")

def human_bytes(b):
    if b == 0:
        return "—"
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if b >= scale and b % scale == 0:
            return f"{b // scale} {unit}"
    return f"{b} B"


def gbps(x):
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}" if x >= 0.01 else f"{x:.2g}"


def usec(x):
    return f"{x:,.1f}" if x < 1000 else f"{x:,.0f}"



def ratio(ours, peer):
    """Speed ratio of two runs of the same op, size and ranks (above 1: ours faster)."""
    return f"{peer['time_us'] / ours['time_us']:.2f}×"


def busbw(r):
    return gbps(r["busbw_gbps"]) if r["bytes"] else "—"


def render_two_hosts(rows, a):
    st = {(r["op"], r["bytes"], r["per_host"]): r for r in rows if r.get("impl") == "shardtrain"}
    pt = {(r["op"], r["bytes"], r["per_host"]): r for r in rows if r.get("impl") == "pytorch-gloo"}
    out = ["### Across two hosts (network namespaces joined by a veth pair)", "",
           "- Each host is a network namespace of this machine with a launcher of its own (`shardtrain launch "
           "--nnodes 2`), PyTorch under the same launchers with `GLOO_SOCKET_IFNAME` set to the host's "
           "interface. With 2 ranks per host shardtrain goes hierarchically (shared memory inside the host); "
           "an all_reduce of up to 64 KB across hosts goes in one round (every rank sends its buffer to "
           "every peer), larger ones as rings. Same measurement as above; 64 KB: "
           f"{next((r['iters'] for r in rows if r['bytes'] == 65536), '?')} timed iterations.", "",
           "| op | bytes | ranks (per host) | shardtrain time µs | PyTorch Gloo time µs | shardtrain / PyTorch |",
           "|---|---:|---:|---:|---:|---:|"]
    for key in sorted(st, key=lambda k: (k[2], OPS.index(k[0]), k[1])):
        op, b, k = key
        s, p = st[key], pt.get(key)
        out.append(f"| {op} | {human_bytes(b)} | {2 * k} ({k}) | {usec(s['time_us'])} | "
                   + (f"{usec(p['time_us'])} | {ratio(s, p)} |" if p else "— | — |"))
    out.append("")
    return out


def render(rows, a):
    two_hosts = [r for r in rows if r.get("hosts") == 2]
    rows = [r for r in rows if "hosts" not in r]
    st = {(r["op"], r["bytes"], r["world_size"]): r for r in rows
          if r.get("impl") == "shardtrain" and r.get("buffer", "ordinary") == "ordinary"}
    allocated = {(r["op"], r["bytes"], r["world_size"]): r for r in rows
                 if r.get("impl") == "shardtrain" and r.get("buffer") == "allocated"}
    mpi = {(r["op"], r["bytes"], r["world_size"]): r for r in rows if r.get("impl") == "shardtrain-mpi"}
    pt = {(r["op"], r["bytes"], r["world_size"]): r for r in rows
          if r.get("impl") == "pytorch-gloo" and r.get("status") != "unsupported"}
    unsupported = {}
    for r in rows:
        if r.get("impl") == "pytorch-gloo" and r.get("status") == "unsupported":
            unsupported.setdefault(r["op"], r.get("reason", "not supported"))
    memcpy = sorted((r for r in rows if r.get("impl") == "memcpy"), key=lambda r: r["bytes"])
    if not st:
        sys.exit("render_comm.py: no shardtrain results to render")

    dtypes = sorted({r["dtype"] for r in st.values()})
    iters = {}
    for r in st.values():
        if r["bytes"]:
            iters.setdefault(r["bytes"], r["iters"])
    barrier_iters = next((r["iters"] for r in st.values() if r["op"] == "barrier"), None)
    dram = next((r["gbps"] for r in memcpy if r["bytes"] >= 1 << 26), None)
    world_sizes = sorted({k[2] for k in st})

    out = [BEGIN, "", "## Collective communication (CPU, loopback)", ""]
    out.append(f"- Run: {a.date}; `nproc` = {a.nproc} ({a.cpu}); PyTorch {a.torch} (Debian, Gloo backend).")
    out.append(f"- Command: `{a.command}`" + (f" ({a.context})" if a.context else ""))
    out.append(
        "- Method: " + ", ".join(dtypes) + "; each figure is one launch of the ranks on this machine, "
        + "; ".join(f"{human_bytes(b)}: {n} timed iterations" for b, n in sorted(iters.items()))
        + (f"; barrier: {barrier_iters}" if barrier_iters else "")
        + " after a warm-up. Time = mean over iterations of the slowest rank's time; "
        "busbw = bytes/time × 2(n−1)/n for all_reduce, × (n−1)/n for reduce_scatter, all_gather and "
        "all_to_all (each rank's buffer in equal parts to every rank, the last taking the remainder), "
        "× 1 for broadcast (nccl-tests definitions). Ratio = PyTorch time / shardtrain time, the same as "
        "the busbw ratio (above 1: shardtrain faster). % memcpy = shardtrain busbw / the single-thread "
        "64 MB memcpy below, for 64 MB rows. "
        "shardtrain is the gloo backend (rings over TCP, shared memory among the ranks of this host); "
        "MPI is the same program on the mpi backend under `mpirun` (Open MPI; its shared-memory "
        "transport here), and gloo / MPI compares the two backends.")
    over = [n for n in world_sizes if a.nproc and n > a.nproc]
    if over:
        out.append(f"- World size {', '.join(map(str, over))} oversubscribes the {a.nproc} cores: "
                   "ranks time-share the CPUs with each other.")
    out.append("")
    out.append("| op | bytes | ranks | shardtrain busbw GB/s | shardtrain time µs | % memcpy "
               "| PyTorch Gloo busbw GB/s | PyTorch time µs | shardtrain / PyTorch "
               "| MPI busbw GB/s | MPI time µs | gloo / MPI |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    notes = []
    for key in sorted(st, key=lambda k: (OPS.index(k[0]) if k[0] in OPS else 99, k[1], k[2])):
        op, b, n = key
        s = st[key]
        p = pt.get(key)
        if p:
            cols = [busbw(p), usec(p["time_us"]), ratio(s, p)]
        else:
            mark = ""
            if op in unsupported:
                if op not in notes:
                    notes.append(op)
                mark = SUP[notes.index(op)]
            cols = ["n/a" + mark, "—", "—"]
        m = mpi.get(key)
        cols += ([busbw(m), usec(m["time_us"]), ratio(s, m)] if m else ["—", "—", "—"])
        share = f"{100 * s['busbw_gbps'] / dram:.0f} %" if dram and b >= 1 << 26 else "—"
        out.append(f"| {op} | {human_bytes(b)} | {n} | {busbw(s)} | {usec(s['time_us'])} | {share} | "
                   + " | ".join(cols) + " |")
    out.append("")
    if allocated:
        out.append("**In place** — the same all_reduce on memory from `Communicator::allocate` (`bench-comm "
                   "--buffer allocated`), which every rank of the host maps: each rank combines its shard "
                   "from the peers' buffers where they lie and writes the result into them, without "
                   "staging copies (DDP's gradient buckets are such memory). Ratios are time against time.")
        out.append("")
        out.append("| op | bytes | ranks | busbw GB/s | time µs | % memcpy | / ordinary buffer "
                   "| / PyTorch Gloo |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for key in sorted(allocated, key=lambda k: (k[1], k[2])):
            op, b, n = key
            s = allocated[key]
            share = f"{100 * s['busbw_gbps'] / dram:.0f} %" if dram and b >= 1 << 26 else "—"
            plain, p = st.get(key), pt.get(key)
            out.append(f"| {op} | {human_bytes(b)} | {n} | {busbw(s)} | {usec(s['time_us'])} | {share} | "
                       f"{ratio(s, plain) if plain else '—'} | {ratio(s, p) if p else '—'} |")
        out.append("")
    if memcpy:
        out.append("**Loopback ceiling** — single-thread `memcpy` (bench/memcpy_bw.cpp, median of 5 trials): "
                   + ", ".join(f"{human_bytes(r['bytes'])}: {gbps(r['gbps'])} GB/s" for r in memcpy)
                   + ". The 1 KB and 1 MB figures are cache-resident; 64 MB is the DRAM figure, the one "
                   "to compare with large collectives (loopback TCP copies every byte at least twice).")
        out.append("")
    for i, op in enumerate(notes):
        extra = (" Its all_gather into a list of separate tensors works but is a different "
                 "operation (n outputs plus copies), so it is not used as a peer."
                 if op == "all_gather" else "")
        out.append(f"{SUP[i]} PyTorch {a.torch}'s Gloo process group does not implement {op} "
                   f"(probe: “{unsupported[op]}”).{extra}")
    if notes:
        out.append("")
    if two_hosts:
        out += render_two_hosts(two_hosts, a)
    out.append(END)
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--cpu", default="unknown CPU")
    ap.add_argument("--torch", default="?")
    ap.add_argument("--command", required=True)
    ap.add_argument("--context", default="", help="free text shown after the command (timing, load)")
    a = ap.parse_args()

    section = render(benchlib.load_jsonl(a.results, "render_comm.py"), a)
    benchlib.write_section(a.out, BEGIN, END, section, "render_comm.py")
    print(section)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
