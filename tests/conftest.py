"""Shared test configuration: every warning is an error (pyproject), seeds are fixed."""
