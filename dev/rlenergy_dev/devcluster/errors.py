"""Errors raised by the dev cluster (part of the project's ``rlenergy.errors`` vocabulary)."""

from __future__ import annotations

from rlenergy import errors


class DevClusterError(errors.RLEnergyError):
    """The dev cluster could not be started, queried or stopped; the message has the log tail."""


class MissingBinaryError(DevClusterError, errors.PermanentError):
    """A control-plane binary is missing; the message names the command that builds it."""
