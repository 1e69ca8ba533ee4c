"""Targets and the markdown report of ``bench/kvtransfer.py`` (from its result dict)."""

from __future__ import annotations

from _common import fmt as _f

#: the issue's targets: gRPC >= 60 % of raw loopback TCP (GB/s) at every prompt of a full run
#: (1k and 8k tokens), >= 40 % in a ``--quick`` run; torch_dist stays >= 60 %; a 1k-token
#: prompt's gRPC transfer <= 10 % of its prefill time.
MIN_RATIO_RAW, MIN_RATIO_RAW_QUICK, MIN_RATIO_RAW_DIST = 0.6, 0.4, 0.6
MAX_RATIO_PREFILL, PREFILL_TARGET_TOKENS = 0.10, 1024

SENDER_STAGES = (("onepass", "gather + CRC32C + framing in one pass, straight into the message (`onepass.frame_kv_chunk`)"),
                 ("gather", "gather (`index_select` of the blocks into a reused buffer in the real path)"),
                 ("crc32c", "CRC32C of the blocks (in place)"),
                 ("header", "msgpack header + the frame around a view of the blocks"),
                 ("frame", "`frame_bytes` (gRPC's request serializer: the one copy of the payload)"))
RECEIVER_STAGES = (("parse", "`parse_frame` (gRPC's request deserializer: a view into the message)"),
                   ("crc32c", "CRC32C check (in place)"),
                   ("decode_rest", "rest of `decode_chunk` (header checks, the read-only tensor view)"),
                   ("write", "`TransferTable.write` (row copies from the view into the reserved blocks)"))


def _floor_row(rows: list, p: dict, limit: float) -> None:
    v = p["ratio_raw_tcp"]
    rows.append({"target": f"{p['transport']} GB/s / raw loopback TCP GB/s", "prompt_tokens": p["prompt_tokens"],
                 "limit": f">= {limit:.2f}", "value": v, "met": v >= limit,
                 "shortfall": None if v >= limit else 1 - v / limit})


def targets(res: dict) -> list[dict]:
    """One row per (target, prompt) measured: value, met, and the shortfall when missed
    (1 - value / minimum for a floor; value / maximum - 1 for a ceiling)."""
    rows: list[dict] = []
    for p in res["points"]:
        if p["transport"] == "torch_dist":
            _floor_row(rows, p, MIN_RATIO_RAW_DIST)
        if p["transport"] != "grpc":
            continue
        _floor_row(rows, p, MIN_RATIO_RAW_QUICK if res["quick"] else MIN_RATIO_RAW)
        if p["prompt_tokens"] == PREFILL_TARGET_TOKENS:
            v = p["ratio_prefill_time"]
            rows.append({"target": "grpc transfer time / prefill time", "prompt_tokens": p["prompt_tokens"],
                         "limit": "<= 0.10", "value": v, "met": v <= MAX_RATIO_PREFILL,
                         "shortfall": None if v <= MAX_RATIO_PREFILL else v / MAX_RATIO_PREFILL - 1,
                         "value_at_roofline": p.get("ratio_prefill_time_at_roofline")})
    return rows


def _stages(res: dict) -> list[str]:
    out = []
    for n, st in res["grpc_stage_costs"].items():
        grpc = next(p for p in res["points"] if p["transport"] == "grpc" and str(p["prompt_tokens"]) == n)
        raw = next(p for p in res["points"] if p["transport"] == "raw_tcp" and str(p["prompt_tokens"]) == n)
        nb = st["payload_bytes"]
        out += ["", f"**{n}-token prompt** ({nb / 1e6:.1f} MB in {st['num_chunks']} chunks; least of {st['reps']} "
                f"serial runs; the transfer itself took {grpc['latency_ms']:.0f} ms, raw TCP "
                f"{raw['latency_ms']:.0f} ms):", "", "| side | stage | ms | GB/s |", "|---|---|---:|---:|"]
        for side, names in (("sender", SENDER_STAGES), ("receiver", RECEIVER_STAGES)):
            for key, label in names:
                if key not in st[side]:  # the sender's one-pass stage, or the plain path's stages
                    continue
                ms = st[side][key]
                out.append(f"| {side} | {label} | {ms:.1f} | {_f(nb / ms / 1e6 if ms > 0.05 else None)} |")
            out.append(f"| {side} | **sum** | **{sum(st[side].values()):.1f}** | |")
        pc = st.get("plain_copy")
        if pc:
            out += ["", f"For reference, the same bytes copied in chunk-sized pieces: into fresh pages (a new "
                    f"anonymous `mmap` each) {pc['fresh_copy']:.1f} ms ({nb / pc['fresh_copy'] / 1e6:.2f} GB/s), into "
                    f"one reused buffer {pc['reused_copy']:.1f} ms ({nb / pc['reused_copy'] / 1e6:.2f} GB/s). The gather "
                    "fills one reused buffer and the write goes into the cache; the framed message (and gRPC's own "
                    "buffers) are new allocations each chunk, kept on mapped pages by the process's malloc settings "
                    "(`kvtransfer/memory.py`; without them every message faults fresh pages in, at the first rate)."]
        stages = sorted(((st[side][k], f"{side}: {label}") for side, names in (("sender", SENDER_STAGES),
                         ("receiver", RECEIVER_STAGES)) for k, label in names if k in st[side]), reverse=True)[:3]
        out += ["", "Largest stages here: " + "; ".join(f"{label} ({ms:.0f} ms)" for ms, label in stages) + "."]
    return out


def _py_spy(res: dict) -> list[str]:
    pr = res.get("py_spy")
    if not pr:
        return ["", "py-spy was not run."]
    out = ["", f"py-spy ({pr['rate_hz']} Hz, `--nonblocking`) over {pr['transfers']} gRPC transfers of the "
           f"{pr['prompt_tokens']}-token prompt ({pr['wall_s']:.1f} s, sampling included), each sample classified by "
           "its innermost Python line (C work counts for the line that called it; waits are left out):", ""]
    for side in ("sender", "receiver"):
        s = pr[side]
        out += [f"*{side}* ({s['busy_samples']} busy of {s['samples']} samples):", "",
                "| category | share of busy samples |", "|---|---:|"]
        out += [f"| {c['category']} | {c['share_of_busy']:.1%} |" for c in s["categories"]]
        out += ["", "| busiest innermost lines | share |", "|---|---:|"]
        out += [f"| `{t['frame']}` | {t['share_of_busy']:.1%} |" for t in s["top_lines"]] + [""]
    nat = pr.get("sender_native")
    if nat and nat["samples"]:
        out += [f"Below the sender's gRPC core calls (*{nat['category']}*): innermost native frames of a second "
                f"py-spy pass with `--native` (blocking, 250 Hz) over {2 * pr['transfers']} more transfers, "
                f"{nat['samples']} samples:", "", "| native frame | share |", "|---|---:|"]
        out += [f"| `{t['frame']}` | {t['share']:.1%} |" for t in nat["leaves"]] + [""]
    return out


def _why(r: dict) -> list[str]:
    """Where the gRPC path stands against raw TCP and against gRPC Python's own floor, in this run's numbers."""
    out = ["", "Where the gRPC path's time goes, from the sections below:", ""]
    for n, st in r["grpc_stage_costs"].items():
        pts = {p["transport"]: p for p in r["points"] if str(p["prompt_tokens"]) == n}
        raw, grpc_, floor = pts["raw_tcp"], pts["grpc"], pts.get("grpc_floor")
        snd, rcv = sum(st["sender"].values()), sum(st["receiver"].values())
        line = (f"* {n} tokens: raw TCP {raw['latency_ms']:.0f} ms, gRPC {grpc_['latency_ms']:.0f} ms "
                f"({grpc_['ratio_raw_tcp']:.2f}x raw)")
        if floor:
            line += (f"; gRPC Python alone moving the same ready messages (`grpc_floor`, no KV work on either side) "
                     f"{floor['latency_ms']:.0f} ms ({floor['ratio_raw_tcp']:.2f}x raw), so the KV work costs the "
                     f"path {grpc_['latency_ms'] - floor['latency_ms']:.0f} ms")
        line += (f". That work, serially: the sender's {snd:.0f} ms (gather, CRC32C, framing), the receiver's "
                 f"{rcv:.0f} ms (split, CRC32C, the write into the blocks), each overlapped with gRPC's own work (a "
                 "producer thread; a read-ahead thread that also splits and checks each message while the "
                 "previous one is written)")
        if floor and grpc_['latency_ms'] - floor['latency_ms'] > max(snd, rcv):
            line += (f"; the path is {grpc_['latency_ms'] - floor['latency_ms'] - max(snd, rcv):.0f} ms slower than "
                     "the floor plus the larger of the two, time its threads spend waiting for the GIL (gRPC "
                     "Python copies messages in and out of its buffers holding it) and for one of the 2 cores the "
                     "other jobs share (`notify` and `consume_request_iterator` lines below)")
        out.append(line + ".")
    dist = [t for t in r["targets"] if t["target"].startswith("torch_dist") and not t["met"]]
    if dist:
        out.append("* torch_dist misses its target at " + ", ".join(f"{t['prompt_tokens']} tokens ({t['value']:.2f}x)"
                                                               for t in dist)
                   + ": each chunk's tensor goes over gloo after its header went over gRPC, and the receiver "
                   "posts its recv when the header arrives (on the read-ahead thread), checks its CRC32C and "
                   "writes it on the handler's; gloo's TCP pair adds its own copies to the sender's one-pass "
                   "gather and the receiver's check and write.")
    pr = r.get("py_spy")
    if pr:
        for side in ("sender", "receiver"):
            cats = "; ".join(f"{c['category']} {c['share_of_busy']:.0%}" for c in pr[side]["categories"][:4])
            out.append(f"* During real transfers the {side}'s busy samples go to: {cats}.")
    out.append("* Raw TCP copies each byte twice (into the kernel, out of it) between buffers that stay mapped. The "
               "gRPC path copies it three times on the sender (the one-pass gather into the message, gRPC's own "
               "buffer, the kernel) and four times on the receiver (the kernel, gRPC's slices, gRPC Python's one `bytes` of "
               "the message, the write into the blocks) and checksums it on both sides; gRPC Python accepts and "
               "hands over only `bytes`, so two of those copies per side are gRPC's own.")
    return out


def markdown(r: dict) -> str:
    """The report: run conditions, the main table, targets, the gRPC path's costs."""
    out = [
        f"# KV transfer: {r['model']} float32, per transport" + (" (quick)" if r["quick"] else ""),
        "",
        f"Run {r['started_at']}, {r['duration_s'] / 60:.1f} min; {r['cpu']}, {r['cpu_count']} cores; torch "
        f"{r['torch']}, grpcio {r['grpc']}. 1-minute load average {r['load_avg_1m_start']:.2f} at the start, "
        f"{r['load_avg_1m_end']:.2f} at the end (other jobs share the machine; per point below).",
        "",
        f"Processes: {r['processes']}. Threads: {r['thread_budget']}. KV {r['kv_bytes_per_token']:,} bytes per "
        f"token, block size {r['block_size']}; gRPC sends {r['layers_per_chunk']} layers per chunk at most, "
        f"{r['max_chunk_bytes'] / 2**20:.2f} MiB payload per chunk at most, into a reservation of non-contiguous "
        "blocks; raw TCP sends the same number of bytes from one contiguous buffer into one preallocated buffer.",
        "",
        f"Latency: median (min–max) of {r['reps']} transfers per transport, the order of raw TCP, gRPC and the "
        "gRPC floor rotating every repetition (torch_dist after them); *grpc_floor*: gRPC Python alone streaming "
        "the gRPC path's messages, framed beforehand, to a handler that drops them (no KV work on either side: "
        "what gRPC itself costs for these bytes); GB/s = payload bytes / median. *x raw TCP* = GB/s over raw TCP's GB/s (*paired*: "
        "median over repetitions of raw seconds / gRPC seconds). *transfer / prefill*: median transfer seconds "
        "over the prompt's prefill seconds through `ModelRunner` in this run (2048-token chunked steps beyond "
        "2048 tokens); *transfer / roofline prefill*: over the prompt's model FLOPs at the GEMM rate measured "
        "around its prefill (`bench/prefill.py`'s formula), i.e. as if the prefill ran at the roofline: an upper "
        "bound on the ratio that the machine's load hardly moves. *verified*: the receiver's blocks hold exactly "
        "the sent bytes (CRC32 of all layers).",
        "",
        "| prompt tokens | transport | MB | latency ms | GB/s | x raw TCP | x raw TCP paired | transfer / prefill "
        "| prefill s | transfer / roofline prefill | chunks | verified | load 1m before / after |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for p in r["points"]:
        out.append(
            f"| {p['prompt_tokens']} | {p['transport']} | {p['payload_bytes'] / 1e6:.1f} | {p['latency_ms']:.1f} "
            f"({p['latency_ms_min']:.1f}–{p['latency_ms_max']:.1f}) | {p['gb_per_s']:.2f} | {p['ratio_raw_tcp']:.2f} | "
            f"{p['ratio_raw_tcp_paired']:.2f} | {p['ratio_prefill_time']:.3f} | {p['prefill_s']:.2f} | "
            f"{_f(p.get('ratio_prefill_time_at_roofline'), '.3f')} | {p.get('num_chunks', '—')} | "
            f"{'—' if p['verified'] is None else ('yes' if p['verified'] else '**no**')} "
            f"| {p['load_avg_1m']:.2f} / {p['load_avg_1m_after']:.2f} |")
    out += ["", "## Targets", "", "| target | prompt tokens | value | limit | met | missed by |",
            "|---|---:|---:|---|---|---:|"]
    for t in r["targets"]:
        out.append(f"| {t['target']} | {t['prompt_tokens']} | {t['value']:.3f} | {t['limit']} | "
                   f"{'yes' if t['met'] else '**no**'} | {_f(t['shortfall'], '.0%')} |")
    roof = [t for t in r["targets"] if t.get("value_at_roofline") is not None]
    out += [f"\nWith the prefill at its roofline instead of its measured time, the {t['prompt_tokens']}-token "
            f"transfer / prefill ratio would be {t['value_at_roofline']:.3f} (limit 0.10)." for t in roof]
    out += _why(r)
    out += ["", "## Where the gRPC path spends its time", "",
            "Every stage of the gRPC path's own CPU work, run serially in this process over the same chunks, "
            "sender stages at the sender's torch threads and receiver stages at the receiver's (gRPC's HTTP/2 "
            "transport and the socket excluded; sender and receiver overlap in a real transfer, so the sums "
            "bound the work, not the latency):", *_stages(r), *_py_spy(r)]
    return "\n".join(out) + "\n"
