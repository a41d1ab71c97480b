"""Sharding helpers: equal-sized per-rank shards, so every rank runs the same number of steps."""
from __future__ import annotations

import numpy as np

from . import runtime


def shard(*arrays, rank: int | None = None, size: int | None = None, shuffle_seed: int | None = None):
    """Returns this rank's shard of each array (same rows for all), dropping the remainder so
    that every rank gets exactly ``len // size`` rows.

    >>> x_local, y_local = tfsparse.data.shard(x, y)
    """
    if not arrays:
        raise ValueError("shard() needs at least one array")
    n = len(arrays[0])
    for a in arrays[1:]:
        if len(a) != n:
            raise ValueError(f"all arrays must have the same length; got {[len(a) for a in arrays]}")
    rank = runtime.rank() if rank is None else rank
    size = runtime.size() if size is None else size
    per = n // size
    if per == 0:
        raise ValueError(f"{n} rows cannot be split over {size} ranks")
    order = np.arange(n) if shuffle_seed is None else np.random.default_rng(shuffle_seed).permutation(n)
    rows = order[rank * per:(rank + 1) * per]
    out = tuple(np.asarray(a)[rows] for a in arrays)
    return out if len(out) > 1 else out[0]
