"""Shared test helpers (multi-process launcher in :mod:`tests.helpers.dist`)."""
