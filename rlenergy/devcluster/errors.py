"""Errors raised by the dev cluster."""

from __future__ import annotations


class DevClusterError(RuntimeError):
    """The dev cluster could not be started, queried or stopped."""


class MissingBinaryError(DevClusterError):
    """A control-plane binary is missing; the message names the command that builds it."""
