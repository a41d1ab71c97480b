"""The package version (one place: setup.cfg reads it, tfsparse re-exports it)."""
__version__ = "0.2.0"
