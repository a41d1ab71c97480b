"""An independent numpy reference of one exchange round -- every algorithm over every wire --
computed from all ranks' inputs, and of a whole multi-step exchange under a plan.

The wire codecs themselves (tfsparse.wire) are checked against their definitions in
tests/test_wire.py; here they are the definition of "what a message carries".  Everything
else -- selections, the gTop-k tree, Ok-Topk's regions and thresholds, the residual rule --
is plain dense/dictionary arithmetic, written without the aggregators' code paths.

A round returns ``(result, residuals, info)``: the dense global sum (float64), every rank's new
residual (acc, contributed entries removed, plus what that rank's own encodings lost on values
that reached the result), and for Ok-Topk the thresholds used.
"""
from __future__ import annotations

import math

import numpy as np

import refs
from tfsparse.wire import get_wire


def rt(wire, values):
    """What a message of ``values`` (in this order) delivers: decode(encode(values))."""
    return get_wire(wire).roundtrip(np.asarray(values, np.float32))[1]


def split(n, P):
    base, extra = divmod(n, P)
    counts = [base + (1 if i < extra else 0) for i in range(P)]
    return np.concatenate(([0], np.cumsum(counts))).astype(int)


def dense_round(accs, wire):
    P, n = len(accs), accs[0].size
    if wire == "float32":
        return refs.dense_ref(accs), [None] * P, {}
    offs = split(n, P)
    result = np.zeros(n, np.float32)
    residuals = [np.zeros(n, np.float32) for _ in range(P)]
    for j in range(P):  # the owner of block j
        blk = slice(offs[j], offs[j + 1])
        mine = np.zeros(offs[j + 1] - offs[j], np.float32)
        for src in range(P):
            if src == j:
                mine += accs[src][blk]
            else:
                got = rt(wire, accs[src][blk])
                mine += got
                residuals[src][blk] += accs[src][blk] - got  # the sender keeps what its block lost
        out = rt(wire, mine)
        result[blk] = out
        residuals[j][blk] += mine - out  # the owner keeps what the sum lost
    return result.astype(np.float64), residuals, {}


def dense_ring_round(accs, wire):
    """Pipe-SGD's ring reduce-scatter (pipe-sgd-li2018 Fig. 2c/3b), hop by hop: block j starts at
    rank j+1 and travels right; every hop decodes the partial sum, adds its own block and
    re-encodes it (the sender keeps what that encoding lost); the owner j adds its own last and
    encodes the sum once for the allgather."""
    P, n = len(accs), accs[0].size
    offs = split(n, P)
    result = np.zeros(n, np.float32)
    residuals = [np.zeros(n, np.float32) for _ in range(P)]
    for j in range(P):
        blk = slice(offs[j], offs[j + 1])
        partial = accs[(j + 1) % P][blk].copy()
        for hop in range(1, P):
            sender, receiver = (j + hop) % P, (j + hop + 1) % P
            got = rt(wire, partial)
            residuals[sender][blk] += partial - got
            partial = got + accs[receiver][blk]
        out = rt(wire, partial)
        result[blk] = out
        residuals[j][blk] += partial - out
    return result.astype(np.float64), residuals, {}


def selection_round(accs, sels, wire):
    """topk / dgc / gaussiank / dragonn: every rank's selection travels once (in the order of
    ``sels``, which the int8 wire's chunk scales depend on), all-gathered."""
    n = accs[0].size
    result = np.zeros(n, np.float64)
    residuals = []
    for a, sel in zip(accs, sels):
        got = rt(wire, a[sel])
        result[sel] += got
        res = a.copy()
        res[sel] = a[sel] - got
        residuals.append(res)
    return result, residuals, {}


def gtopk_round(accs, k, wire):
    """The gTop-k tree (fold round for surplus ranks, recursive doubling, broadcast); a sent
    vector arrives as decode(encode(values in ascending index order))."""
    P, n = len(accs), accs[0].size
    local = [refs.exact_topk(a, k) for a in accs]
    vecs = [{int(i): np.float32(accs[r][i]) for i in local[r]} for r in range(P)]
    losses = [dict() for _ in range(P)]  # rank -> {index: loss of its encodings}

    def send(r):
        keys = sorted(vecs[r])
        got = rt(wire, [vecs[r][i] for i in keys])
        for i, g in zip(keys, got):
            losses[r][i] = losses[r].get(i, np.float32(0)) + (vecs[r][i] - g)
        return dict(zip(keys, got))

    def merge(received, own):
        keys = sorted(set(received) | set(own))
        summed = {i: np.float32(np.float32(received.get(i, 0.0)) + np.float32(own.get(i, 0.0))) for i in keys}
        mags = np.array([abs(float(summed[i])) for i in keys])
        order = np.argsort(-mags, kind="stable")[:k]
        return {keys[j]: summed[keys[j]] for j in sorted(order)}

    p2 = 1 << (P.bit_length() - 1)
    for i in range(P - p2):
        vecs[i] = merge(send(p2 + i), vecs[i])
    step = 1
    while step < p2:
        for r in range(0, p2, 2 * step):
            vecs[r] = merge(send(r + step), vecs[r])
        step *= 2
    final = send(0) if P > 1 else vecs[0]
    result = np.zeros(n, np.float64)
    for i, v in final.items():
        result[i] = v
    residuals = []
    for r in range(P):
        res = accs[r].copy()
        contributed = [int(i) for i in local[r] if int(i) in final]
        res[contributed] = 0
        for i, lo in losses[r].items():
            if i in final:
                res[i] += lo
        residuals.append(res)
    return result, residuals, {}


def oktopk_boundaries(sels, n, P):
    """§3.1.1: the consensus of every rank's equal-count split of its local selection."""
    per_rank = []
    for sel in sels:
        j = np.arange(1, P)
        per_rank.append((j * n) // P if sel.size < P else sel[(j * sel.size) // P])
    inner = np.clip(np.floor(np.mean(np.stack(per_rank).astype(np.float64), axis=0)).astype(np.int64), 0, n)
    return np.concatenate(([0], inner, [n]))


def oktopk_round(accs, k, wire, local_thresholds=None, global_threshold=None, bounds=None):
    """Ok-Topk without data balancing: owners reduce their region (own entries at full
    precision, the others' decoded), the global threshold comes from the decoded reduced
    values (fresh) or is reused, each owner's kept entries travel once."""
    P, n = len(accs), accs[0].size
    if local_thresholds is None:
        local_thresholds = [refs.kth_largest_magnitude(a, k) for a in accs]
    sels = []
    for a, th in zip(accs, local_thresholds):
        sels.append(np.flatnonzero(np.abs(a) >= th) if th > 0 else np.flatnonzero(a != 0))
    if bounds is None:
        bounds = oktopk_boundaries(sels, n, P)
    losses = [np.zeros(n, np.float32) for _ in range(P)]
    reduced = []  # per owner: (indices, float32 sums)
    for j in range(P):
        lo, hi = bounds[j], bounds[j + 1]
        acc_region = {}
        for r in range(P):
            part = sels[r][(sels[r] >= lo) & (sels[r] < hi)]
            vals = accs[r][part] if r == j else rt(wire, accs[r][part])
            if r != j:
                losses[r][part] += accs[r][part] - vals
            for i, v in zip(part, vals):
                acc_region[int(i)] = np.float32(acc_region.get(int(i), np.float32(0)) + v)
        keys = sorted(acc_region)
        reduced.append((np.array(keys, np.int64), np.array([acc_region[i] for i in keys], np.float32)))
    if global_threshold is None:
        decoded = np.concatenate([rt(wire, v) for _, v in reduced])
        global_threshold = refs.kth_largest_magnitude(decoded, k)
    result = np.zeros(n, np.float64)
    final = set()
    for j, (idx, val) in enumerate(reduced):
        keep = np.ones(val.size, bool) if global_threshold <= 0 else np.abs(val) >= global_threshold
        got = rt(wire, val[keep])
        result[idx[keep]] = got
        losses[j][idx[keep]] += val[keep] - got
        final |= set(int(i) for i in idx[keep])
    final = np.array(sorted(final), np.int64)
    residuals = []
    for r in range(P):
        res = accs[r].copy()
        res[np.intersect1d(sels[r], final)] = 0
        mask = np.zeros(n, bool)
        mask[final] = True
        res[mask] += losses[r][mask]
        residuals.append(res)
    return result, residuals, {"local_thresholds": local_thresholds, "global_threshold": global_threshold,
                               "boundaries": bounds}


def chunk_norms(vecs, cs):
    """Σ over ranks of every ``cs``-element chunk's L1 norm (float64)."""
    n = vecs[0].size
    total = np.zeros(math.ceil(n / cs))
    for v in vecs:
        for c in range(total.size):
            total[c] += np.abs(v[c * cs:(c + 1) * cs].astype(np.float64)).sum()
    return total


def top_chunks(norms, m):
    return np.sort(np.argsort(-norms, kind="stable")[:m])


def csc_round(accs, cs, m, wire, chunks=None):
    """GradientFlow CSC: the ``m`` chunks of largest summed L1 norm (or the given ``chunks``)
    are summed by a dense allreduce of their gathered elements; the rest stays."""
    n = accs[0].size
    if chunks is None:
        chunks = top_chunks(chunk_norms(accs, cs), m)
    elems = np.array([i for c in chunks for i in range(c * cs, min(n, (c + 1) * cs))], np.int64)
    res_e, resid_e, _ = dense_round([a[elems] for a in accs], wire)
    result = np.zeros(n, np.float64)
    result[elems] = res_e
    residuals = []
    for r, a in enumerate(accs):
        res = a.copy()
        res[elems] = 0.0 if resid_e[r] is None else resid_e[r]
        residuals.append(res)
    return result, residuals, {"chunks": chunks, "elems": elems}


def csc_next_chunks(accs, result, elems, cs, m):
    """GradientFlow Fig. 18: next step's chunks from the norms of what every rank holds after
    the allreduce (the sum / P in the chunks sent, its own accumulated gradient elsewhere)."""
    P = len(accs)
    held = []
    for a in accs:
        h = a.astype(np.float64)
        h[elems] = result[elems] / P
        held.append(h)
    return top_chunks(chunk_norms(held, cs), m)


def bucket_k(density, size, algorithm):
    return size if algorithm == "dense" else int(min(size, max(1, math.ceil(density * size))))


def reference_run(algorithm, wire, buckets, grads, density, infos=None, options=None):
    """A whole exchange: ``grads[step][rank]`` flat gradients, ``buckets`` a list of
    ``(start, stop)``, ``infos[step][bucket]`` the implementation's Ok-Topk ``last_info`` (its
    thresholds are reused on reuse steps).  Returns per step the dense result and every
    rank's residual after the step."""
    options = options or {}
    steps, P = len(grads), len(grads[0])
    n = grads[0][0].size
    memory = algorithm != "dense" or wire != "float32"
    residuals = [np.zeros(n, np.float32) for _ in range(P)]
    rngs = {(r, b): np.random.default_rng(options.get("seed")) for r in range(P) for b in range(len(buckets))}
    cached = {}
    out = []
    for s in range(steps):
        accs = [(g + res) if memory else g.copy() for g, res in zip(grads[s], residuals)]
        result = np.zeros(n, np.float64)
        new_res = [a.copy() for a in accs]
        for b, (lo, hi) in enumerate(buckets):
            part = [a[lo:hi] for a in accs]
            k = bucket_k(density, hi - lo, algorithm)
            if algorithm == "dense":
                res_b, resid_b, _ = dense_round(part, wire)
            elif algorithm == "topk":
                res_b, resid_b, _ = selection_round(part, [refs.exact_topk(a, k) for a in part], wire)
            elif algorithm == "gaussiank":
                res_b, resid_b, _ = selection_round(part, [refs.gaussiank_selection(a, k) for a in part], wire)
            elif algorithm == "dgc":
                sels = [refs.dgc_selection(a, k, rngs[(r, b)], **{kk: v for kk, v in options.items() if kk != "seed"})
                        for r, a in enumerate(part)]
                res_b, resid_b, _ = selection_round(part, sels, wire)
            elif algorithm == "dragonn":  # the bucket's s-th round hashes with seed·2**32 + s
                sels = [refs.dragonn_selection(a, k, s, **options) for a in part]
                res_b, resid_b, _ = selection_round(part, sels, wire)
            elif algorithm == "gtopk":
                res_b, resid_b, _ = gtopk_round(part, k, wire)
            elif algorithm == "csc":
                cs = options.get("chunk_size", 32768)
                m = min(math.ceil((hi - lo) / cs), math.ceil(k / cs))
                prev = cached.get(b)
                known = prev if options.get("chunk_selection") == "previous" and prev is not None and prev.size == m else None
                res_b, resid_b, got = csc_round(part, cs, m, wire, known)
                if options.get("chunk_selection") == "previous":
                    cached[b] = csc_next_chunks(part, res_b, got["elems"], cs, m)
            else:  # oktopk: the schedule of tau / tau_prime (t counted from 1)
                t = s + 1
                fresh = (t - 1) % options.get("tau_prime", 32) == 0
                repartition = (t - 1) % options.get("tau", 64) == 0
                prev = cached.get(b)
                info = infos[s][b] if infos is not None else None
                res_b, resid_b, got = oktopk_round(
                    part, k, wire,
                    None if fresh else prev["local_thresholds"], None if fresh else prev["global_threshold"],
                    None if repartition else prev["boundaries"])
                if info is not None:
                    assert info["fresh_thresholds"] == fresh and info["repartitioned"] == repartition
                    assert not info["balanced"]
                if fresh or repartition:
                    cached[b] = {**(prev or {}), **({"local_thresholds": got["local_thresholds"],
                                                     "global_threshold": got["global_threshold"]} if fresh else {}),
                                 "boundaries": got["boundaries"]}
            result[lo:hi] = res_b
            for r in range(P):
                new_res[r][lo:hi] = resid_b[r] if resid_b[r] is not None else 0
        if memory:
            residuals = new_res
        out.append((result, [r.copy() for r in residuals] if memory else None))
    return out


def momentum_reference(algorithm, grads, density, m=0.9, options=None, kept=None):
    """DGC §3.2 momentum correction with factor masking, from every rank's gradients:
    u = m·u + g; acc = v + u; sparse allreduce of acc; v = acc with the sent entries cleared;
    u cleared where sent -- except a dense exchange, which keeps u (momentum SGD), and the
    positions where ``kept`` (a bool vector) is True (``memory="momentum_rows"``'s row-sparse
    tensors)."""
    P, n = len(grads[0]), grads[0][0].size
    u = [np.zeros(n, np.float32) for _ in range(P)]
    v = [np.zeros(n, np.float32) for _ in range(P)]
    out = []
    for step in grads:
        accs = []
        for r in range(P):
            u[r] = (np.float32(m) * u[r] + step[r]).astype(np.float32)
            accs.append(v[r] + u[r])
        k = n if algorithm == "dense" else math.ceil(density * n)
        if algorithm == "dense":
            result = np.sum(np.stack(accs).astype(np.float64), axis=0)
            sent = [np.arange(n)] * P
        elif algorithm in ("topk", "dragonn", "dgc"):
            if algorithm == "topk":
                sent = [refs.exact_topk(a, k) for a in accs]
            elif algorithm == "dragonn":
                sent = [refs.dragonn_selection(a, k, len(out), **(options or {})) for a in accs]
            else:  # every element sampled (options["min_samples"] >= n): no random draws
                sent = [refs.dgc_selection(a, k, None, **options) for a in accs]
            result = np.zeros(n)
            for a, idx in zip(accs, sent):
                result[idx] += a[idx]
        else:  # csc
            cs = options["chunk_size"]
            result, _, info = csc_round(accs, cs, min(math.ceil(n / cs), math.ceil(k / cs)), "float32")
            sent = [info["elems"]] * P
        for r in range(P):
            v[r] = accs[r].copy()
            v[r][sent[r]] = 0.0
            if algorithm != "dense":
                masked = np.asarray(sent[r])
                u[r][masked if kept is None else masked[~kept[masked]]] = 0.0
        out.append((result, [x.copy() for x in v], [x.copy() for x in u]))
    return out


def tree_sum(vectors):
    """The two-level exchange's host sum (tfsparse.hierarchy): float32 vectors added up a
    binomial tree to the first -- ``(v0 + v1) + (v2 + v3)`` for four."""
    parts = [np.asarray(v, np.float32).copy() for v in vectors]
    d = 1
    while d < len(parts):
        for r in range(0, len(parts), 2 * d):
            if r + d < len(parts):
                parts[r] = parts[r] + parts[r + d]
        d *= 2
    return parts[0]
