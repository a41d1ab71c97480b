"""Subprocess scripts for tests/test_ops_cuda.py (run with NUMBA_ENABLE_CUDASIM=1)."""
