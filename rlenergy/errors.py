"""Framework-free error vocabulary shared by the library, the operator and the agent.

Handlers translate these into kopf's errors at the edge: ``PermanentError`` means do not
retry (the input is wrong and must change), ``RetryableError`` carries a delay in seconds.
"""

from __future__ import annotations


class RLEnergyError(Exception):
    """Base class of every error raised on purpose by this project."""


class PermanentError(RLEnergyError):
    """Retrying cannot help: the input must change. The message says what to change."""


class RetryableError(RLEnergyError):
    """A transient condition; retry after ``delay_s`` seconds.

    Args:
        message: what happened.
        delay_s: suggested wait before retrying, seconds.
    """

    def __init__(self, message: str, delay_s: float = 10.0) -> None:
        super().__init__(message)
        self.delay_s = delay_s


class InFlightError(RetryableError):
    """An operation was sent and may still be running; its outcome is not known yet.

    Never to be reported as "nothing happened": the caller must poll until it ends (an
    elastic-EP resize whose blocking call timed out after it was sent).
    """


class InvalidInputError(PermanentError):
    """User input (a trace, a policy, a CLI argument) is invalid.

    Args:
        field: the field, flag or file position that is wrong (``phases[0].minThroughputRatio``).
        message: what is wrong and what values are allowed.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Pickled with its own arguments: the default passes only the formatted message, and
        # a process pool then fails to rebuild the error and reports a broken pool instead.
        return type(self), (self.field, self.reason)
