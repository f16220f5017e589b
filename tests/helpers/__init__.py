"""Helpers for the tests (never imported by the package)."""
