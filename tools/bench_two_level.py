"""The two-level exchange (``hierarchical=True``) against the flat one, and the α-β model of both
(:func:`tfsparse.timing.simulate_two_level`), on hosts emulated on this machine:

    tfsparse-run -np 4 --emulate-hosts 2 --net 1gbit python tools/bench_two_level.py [--n 17088522]
        [--steps 8] [--out results/bench_two_level]

Numpy only (no TensorFlow).  Every rank takes a gradient of ``--n`` float32 elements (Laplace
noise, its own seed; the digits MLP's 17.1M by default) through :class:`GradientExchange` for
dense over float16 and gTop-k, Ok-Topk and top-k at density 0.01 (plain error feedback), flat
and in two levels, side by side in one launch.  Per setting: the round (``start`` to ``wait``,
the slowest rank's median over the steps after the first), and rank 0's parts of it: the
algorithm's collectives (``comm_ms``), the host's sum and broadcast (``host_sum_ms``,
``share_ms``; two-level only).  The links are measured in the same launch
(:func:`~tfsparse.collectives.measure_alpha_beta`: rank 0 to the first rank of another host -- the
network -- and to rank 1 -- shared memory), and the model prices each setting with them: the
flat exchange with the host's ranks sharing its link, the two-level one over the hosts plus the
host's copies (``model_comm_ms`` beside the measured communication: ``comm_ms``, plus the host's
parts for two levels; the model takes those as measured: their cost is this machine's memory
traffic, which the α-β model does not describe), and both again at 128 hosts x 8 ranks.

Rank 0 writes ``<out>.json`` and ``<out>.png`` and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETTINGS = [("dense f16", {"algorithm": "dense", "wire_dtype": "float16"}),
            ("gtopk 0.01", {"algorithm": "gtopk", "density": 0.01}),
            ("oktopk 0.01", {"algorithm": "oktopk", "density": 0.01}),
            ("topk 0.01", {"algorithm": "topk", "density": 0.01})]


def run_setting(comm, grads, options: dict, two_level: bool, steps: int) -> dict:
    from tfsparse.exchange import GradientExchange

    ex = GradientExchange(communicator=comm, hierarchical=two_level, memory="residual", **options)
    times, comm_s, sums, shares = [], [], [], []
    for s in range(steps):
        comm.barrier()
        before = (ex.total.comm_seconds,) + ((ex.two_level.sum_seconds, ex.two_level.share_seconds)
                                             if ex.two_level is not None else (0.0, 0.0))
        t0 = time.perf_counter()
        ex.exchange_numpy(grads[s % len(grads)])
        dt = time.perf_counter() - t0
        times.append(max(float(v[0]) for v in comm.allgather(np.array([dt]))))
        comm_s.append(ex.total.comm_seconds - before[0])
        if ex.two_level is not None:
            sums.append(ex.two_level.sum_seconds - before[1])
            shares.append(ex.two_level.share_seconds - before[2])
    ex.close()
    med = lambda xs: round(1e3 * float(np.median(xs[1:])), 1) if xs else 0.0  # noqa: E731  (first step: warm-up)
    return {"round_ms": med(times), "comm_ms": med(comm_s), "host_sum_ms": med(sums), "share_ms": med(shares),
            "mb_per_step": ex.total.bytes_sent / steps / 1e6}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=17_088_522, help="gradient elements per rank")
    parser.add_argument("--steps", type=int, default=8, help="rounds per setting (the first is not counted)")
    parser.add_argument("--out", default="results/bench_two_level")
    args = parser.parse_args(argv)

    import tfsparse
    from tfsparse.collectives import measure_alpha_beta
    from tfsparse.collectives.hosts import host_ids
    from tfsparse.timing import simulate_two_level
    from tfsparse.wire import get_wire

    comm = tfsparse.init(backend="mpi")
    ids = host_ids(comm)
    hosts, per_host = len(set(ids)), max(ids.count(h) for h in set(ids))
    if hosts < 2 or per_host < 2:
        raise SystemExit(f"bench_two_level needs several hosts of several ranks (got {hosts} host(s), at most "
                         f"{per_host} rank(s) on one): launch it with tfsparse-run -np 4 --emulate-hosts 2")
    peer = next(r for r, h in enumerate(ids) if h != ids[0])
    network = measure_alpha_beta(comm, peer=peer)
    try:  # shared memory: for the record only (the model takes the host's parts as measured)
        shared = measure_alpha_beta(comm, peer=1 if ids[1] == ids[0] else peer)
    except ValueError:  # (every rank alike) a copy this fast is noise on a busy node
        shared = None
    rng = np.random.default_rng(comm.rank)
    grads = [rng.laplace(size=args.n).astype(np.float32) for _ in range(2)]
    runs = []
    for label, options in SETTINGS:
        row = {"label": label, **options}
        for two in (False, True):
            got = run_setting(comm, grads, options, two, args.steps)
            row.update({f"{'two_level' if two else 'flat'}_{k}": v for k, v in got.items()})
        density = options.get("density", 1.0)
        value_bytes = get_wire(options.get("wire_dtype", "float32")).value_bytes
        # the host's parts as measured here (their memory traffic on this machine), the network's priced
        add_s = 1e-3 * row["two_level_host_sum_ms"] / (per_host - 1).bit_length()
        level_s = 1e-3 * row["two_level_share_ms"] / (per_host - 1).bit_length()
        model = simulate_two_level(options["algorithm"], hosts, per_host, args.n, density, network,
                                   add_s=add_s, level_s=level_s, value_bytes=value_bytes)
        big = simulate_two_level(options["algorithm"], 128, 8, args.n, density, network, add_s=add_s,
                                 level_s=level_s, value_bytes=value_bytes)
        row.update({"speedup": round(row["flat_round_ms"] / row["two_level_round_ms"], 2),
                    "flat_model_comm_ms": round(1e3 * model["flat_s"], 1),
                    "two_level_model_comm_ms": round(1e3 * model["two_level_s"], 1),
                    "two_level_model_network_ms": round(1e3 * model["phases_s"]["across hosts"], 1),
                    "two_level_measured_comm_ms": round(row["two_level_comm_ms"] + row["two_level_host_sum_ms"]
                                                        + row["two_level_share_ms"], 1),
                    "model_128x8_flat_ms": round(1e3 * big["flat_s"], 1),
                    "model_128x8_two_level_ms": round(1e3 * big["two_level_s"], 1)})
        runs.append(row)
        if comm.rank == 0:
            print(json.dumps(row), flush=True)
    if comm.rank != 0:
        return
    result = {"machine": socket.gethostname(), "ranks": comm.size, "hosts": hosts, "per_host": per_host, "n": args.n,
              "steps": args.steps, "network": {"alpha_s": network.alpha, "beta_bytes_per_s": network.beta, "text": str(network)},
              "shared_memory": None if shared is None else {"alpha_s": shared.alpha, "beta_bytes_per_s": shared.beta,
                                                            "text": str(shared)}, "command": "tfsparse-run -np 4 --emulate-hosts 2 --net 1gbit python "
              "tools/bench_two_level.py", "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(table(result))


def table(result) -> str:
    lines = ["| setting | flat round ms | two-level round ms | x | flat network ms (model) | two-level network "
             "ms (model) | host sum + broadcast ms | model 128x8: flat / two-level ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['label']} | {r['flat_round_ms']} | {r['two_level_round_ms']} | {r['speedup']} | "
                     f"{r['flat_comm_ms']} ({r['flat_model_comm_ms']}) | {r['two_level_comm_ms']} "
                     f"({r['two_level_model_network_ms']}) | {r['two_level_host_sum_ms']} + {r['two_level_share_ms']} | "
                     f"{r['model_128x8_flat_ms']} / {r['model_128x8_two_level_ms']} |")
    return "\n".join(lines)


def plot(result, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    y = np.arange(len(runs))
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(y - 0.2, [r["flat_round_ms"] for r in runs], 0.4, label="flat")
    ax.barh(y + 0.2, [r["two_level_round_ms"] for r in runs], 0.4, label="two-level")
    ax.set_yticks(y, [r["label"] for r in runs])
    ax.invert_yaxis()
    ax.set_xlabel("exchange round (ms), slowest rank, median")
    ax.set_title(f"{result['ranks']} ranks on {result['hosts']} emulated hosts, {result['n']:,} elements")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
