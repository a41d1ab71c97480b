"""Cross-rank agreement on a configuration: one small collective, the same error on every rank.

Ranks that disagree on what they exchange (another algorithm, density or option on one rank,
another layer size) would otherwise wait in mismatched collectives forever, or train silently
apart.  :func:`check_agreement` all-gathers a 32-byte digest of a description; only when the
digests differ does it gather the descriptions themselves, to name the ranks and the
difference, and every rank raises the same :class:`ConfigurationMismatch`.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np


class ConfigurationMismatch(ValueError):
    """Ranks were configured differently; raised with the same message on every rank."""


def _plain(value):
    """A JSON stand-in for values json cannot write: functions by name, others by type."""
    return getattr(value, "__qualname__", None) or type(value).__name__


def describe(description) -> str:
    """The canonical text of a description that ranks compare.

    Args:
      description: anything JSON-like (functions by name, other objects by type).

    Returns:
      JSON with sorted keys.
    """
    return json.dumps(description, sort_keys=True, default=_plain)


def _flatten(value, prefix="") -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and value and all(isinstance(v, (list, dict)) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        if prefix:
            out[f"len({prefix})"] = len(value)
        return out
    return {prefix: value}


def differences(a, b, limit: int = 4) -> list[str]:
    """The first keys whose values differ between two decoded descriptions.

    Args:
      a: one description (decoded JSON).
      b: the other.
      limit: how many to name (a last line counts the rest).

    Returns:
      Lines ``key: a's value vs b's value``.
    """
    fa, fb = _flatten(a), _flatten(b)
    keys = sorted(set(fa) | set(fb), key=lambda k: (k.startswith("len("), k))
    out = [f"{k}: {fa.get(k, '<absent>')!r} vs {fb.get(k, '<absent>')!r}" for k in keys if fa.get(k) != fb.get(k)]
    return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])


def check_agreement(comm, subject: str, description, hint: str = "") -> None:
    """Collective: raises on every rank when the ranks' descriptions differ.

    Costs one allgather of 32 bytes per rank when they agree.

    Args:
      comm: the communicator (every rank calls it).
      subject: what is compared, as the message names it.
      description: this rank's description (anything JSON-like).
      hint: a last line for the message (how to fix it); empty: none.

    Raises:
      ConfigurationMismatch: naming the ranks that differ from rank 0 and how.
    """
    if comm.size == 1:
        return
    text = describe(description).encode()
    digest = np.frombuffer(hashlib.sha256(text).digest(), np.uint8)
    digests = comm.allgather(digest)
    if all(np.array_equal(d, digests[0]) for d in digests):
        return
    texts = [bytes(p.astype(np.uint8)).decode() for p in comm.allgather(np.frombuffer(text, np.uint8))]
    base = json.loads(texts[0])
    lines = []
    for r, t in enumerate(texts[1:], start=1):
        if t != texts[0]:
            lines.append(f"  rank {r} vs rank 0: " + "; ".join(differences(json.loads(t), base)))
    odd = [r for r in range(1, comm.size) if texts[r] != texts[0]]
    raise ConfigurationMismatch(f"ranks disagree on {subject}: rank{'s' if len(odd) > 1 else ''} "
                                f"{', '.join(map(str, odd))} differ{'' if len(odd) > 1 else 's'} from rank 0\n"
                                + "\n".join(lines) + (f"\n{hint}" if hint else ""))
