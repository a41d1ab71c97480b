"""Sparse allreduce algorithms (one module per paper), looked up by name."""
from .base import Aggregator, AllreduceResult, sparse_decode
from .registry import aggregator_options, available_aggregators, get_aggregator, register
from . import dense, topk, gtopk, oktopk, threshold, csc, dragonn  # noqa: F401  (modules register themselves)

__all__ = ["Aggregator", "AllreduceResult", "sparse_decode", "aggregator_options", "available_aggregators", "get_aggregator", "register"]
