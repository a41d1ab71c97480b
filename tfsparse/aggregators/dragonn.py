"""DRAGONN: hashing-based gradient sparsification (dragonn-wang2022 §3.2, Alg. 1; §4, Alg. 2).

One step on every rank, for a bucket of ``n`` elements and a budget ``k``:

1. **threshold** -- DGC's sampled estimate of the k-th largest ``|acc|`` (§2.3, Alg. 3 lines
   1-2: a 1% sample, its ``ceil(k·s/n)``-th largest magnitude; :func:`tfsparse.ops.sample_threshold`),
   the exact k-th largest when the sample would hold fewer than ``min_samples`` elements;
2. **hashing-based index extraction** (Alg. 1) -- every ``i`` with ``|acc[i]| >= t`` is written to
   slot ``h(i)`` of a table of ``m = capacity_factor · k`` slots (default ``4k``: the authors'
   ``torch.zeros(num_selects * 4)``); colliding indices overwrite each other, so exactly one of
   them survives per slot (:func:`tfsparse.ops.hash_select`: the largest, deterministically).
   ``h`` is drawn from a universal family by a **per-step seed** that every rank derives
   identically from ``seed`` and the step counter (the authors' ``seed_cnt``, incremented per
   call).  There is no prefix sum and no sort: one read and one compare per element, one hash
   and one write per selected element (§3.2, "Algorithm Complexity");
3. the occupied slots (index ``!= -1``) are packed as one ``[indices | values]`` message --
   Alg. 1's table with its empty slots removed, as the authors' code does before communicating
   (``indices[indices.nonzero()]``): empty slots never travel, nor reach the sum.  Here the
   entries travel in index order rather than slot order (the same entries; taken in order
   without a sort where the selection is fused with error feedback,
   :meth:`~tfsparse.compressors.HashedThreshold.compress`), so that their indices travel blocked
   (:class:`~tfsparse.wire.BlockedIndices`, three quarters of int32's bytes) and the P payloads
   are summed in one sequential pass;
4. **allgather** of the P messages (Alg. 2 "communicate", §4.2: compressed tensors are not
   allreducible, "Allgather is commonly used");
5. **sparse decoding** (§4.3, :func:`~tfsparse.aggregators.base.sparse_decode`, which the
   allgather baselines share) -- the P payloads are decoded together by **one** pass into the
   dense sum ("we batch these K compressed tensors, i.e. concatenate all of them, for one
   decoding operation"; :func:`tfsparse.ops.cpu.densify_into`), summed in rank order, so every
   rank gets bit-identical sums; no per-rank dense decode, no sort, no ``np.unique``.

Volume per rank: ``(P-1)`` messages of at most ``m`` entries -- about ``0.89 k`` when the
threshold passes ``k`` elements into ``4k`` slots (``m(1-(1-1/m)^k)`` occupied) -- of
``index + value`` bytes on the wire (``wire_dtype`` for the values).  What collisions and a
threshold set too high leave out stays in the residual (error feedback; App. A.2 bounds the
resulting error); the achieved density is reported like the other algorithms' (``sent_elements``).

Schedule: topk's (:meth:`~tfsparse.aggregators.topk.AllgatherAggregator.schedule`) with the
expected number of occupied slots, ``m(1-(1-1/m)^l)`` of ``m = 4k`` for the ``l ≈ k`` elements
the threshold passes (:meth:`tfsparse.compressors.HashedThreshold.expected_count`), and one
sparse decode of the ``P`` payloads.

Differences from the authors' code: their table starts at 0 rather than -1, so index 0 can
never be sent (here it can); their seed counter is shared by all tensors (here each bucket
counts its own steps); their tensors of at most 131072 elements run at density 0.01 whatever
the requested density -- that one changes what small tensors send, so it is an option,
``small_density=0.01`` (default None: the requested density holds).
"""
from __future__ import annotations

from ..compressors import HashedThreshold
from .base import reject_unknown_options
from .registry import register
from .topk import AllgatherAggregator


@register("dragonn")
class DragonnAllgather(AllgatherAggregator):
    """DRAGONN (dragonn-wang2022 Alg. 1 + Alg. 2): sampled threshold, hashed index extraction
    into ``capacity_factor · k`` slots (:class:`~tfsparse.compressors.HashedThreshold`),
    allgather, one sparse decode of all P payloads.

    Args:
      capacity_factor: slots per selected element, ``m = capacity_factor · k`` (default 4, the
        authors' choice; an integer >= 1).
      sample_ratio: fraction of the gradient sampled for the threshold (default 0.01, DGC's 1%).
      min_samples: the fewest positions sampled (default 1024); a tensor of at most this many
        elements takes the exact k-th largest magnitude.
      seed: base seed of the hash functions and the sampling positions (default 0); step ``s``
        uses ``seed · 2**32 + s`` on every rank.
      small_density: None (default), or the authors' behaviour: every tensor of at most 131072
        elements runs at this density (their 0.01) whatever the requested density.
      **unknown: any other keyword is refused (ValueError naming the accepted options).

    State (``get_state``): the step counter, so a resumed run hashes exactly as an
    uninterrupted one.
    """

    OPTIONS = ("capacity_factor", "sample_ratio", "min_samples", "seed", "small_density")
    DECODE = "sparse decode of the gathered pairs"

    def __init__(self, capacity_factor: int = 4, sample_ratio: float = 0.01, min_samples: int = 1024, seed: int = 0,
                 small_density: float | None = None, **unknown):
        reject_unknown_options("dragonn", unknown, self.OPTIONS)
        super().__init__(compressor=HashedThreshold(capacity_factor=capacity_factor, sample_ratio=sample_ratio,
                                                    min_samples=min_samples, seed=seed, small_density=small_density))
