"""Per-prompt response-length prediction from earlier epochs (FlexFloor step 1).

RL datasets are replayed epoch after epoch, and a prompt that drew long responses last epoch
tends to draw long ones again. The predictor keeps, per prompt, the mean log length of its
responses in its last ``history_epochs`` appearances, and corrects for drift of the whole
distribution (RL response lengths grow or shrink during training): a prompt's log offset from
the step mean at the time it was seen is added to the latest step's mean log length. A prompt
never seen before gets the ``fallback_quantile`` of the latest step's lengths, or
``default_length_tokens`` before any step was observed. Each observed step also scores what
the predictor would have said for it: the root mean square of ``ln(actual / predicted)``, kept
separately for history-based and fallback predictions (``log_error_sigma``), tells a caller
how far to trust a prediction (the placement guard forecasts over that spread).

Pure and deterministic; callers: ``rlenergy.control.moe.placement`` inputs, the simulator and
the trainer SDK.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from collections.abc import Hashable, Iterable, Sequence

from rlenergy import errors


@dataclasses.dataclass(frozen=True)
class LengthPrediction:
    """Predicted response length of one prompt.

    Attributes:
        length_tokens: predicted response length, tokens (>= 1).
        from_history: ``True`` when the prompt's own history was used, ``False`` for the
            quantile fallback.
    """

    length_tokens: float
    from_history: bool


class ResidualLength:
    """Expected remaining decode steps of a response, from one step's observed lengths.

    A response still running below its predicted length has ``predicted - generated`` steps
    left. One that ran past its prediction has, by the empirical distribution of the latest
    finished step, ``E[L - generated | L > generated]`` left (the mean residual life; in a
    heavy tail it grows with ``generated``), at least 1. Pure; used for the release guard's
    horizon [MODEL: the latest step's lengths stand in for this step's; drift ignored].

    Args:
        lengths_tokens: response lengths of a finished step, tokens (any order, >= 1).

    Raises:
        InvalidInputError: no length.
    """

    def __init__(self, lengths_tokens: Sequence[float]) -> None:
        if not lengths_tokens:
            raise errors.InvalidInputError("lengths_tokens", "need at least one length")
        self._sorted = sorted(float(x) for x in lengths_tokens)
        suffix = [0.0] * (len(self._sorted) + 1)
        for i in range(len(self._sorted) - 1, -1, -1):
            suffix[i] = suffix[i + 1] + self._sorted[i]
        self._suffix = suffix

    def remaining(self, predicted_tokens: float, generated_tokens: float) -> float:
        """Expected decode steps left for one response (>= 1)."""
        if generated_tokens < predicted_tokens:
            return max(predicted_tokens - generated_tokens, 1.0)
        i = bisect.bisect_right(self._sorted, generated_tokens)
        count = len(self._sorted) - i
        if count == 0:
            return 1.0
        return max(self._suffix[i] / count - generated_tokens, 1.0)


class LengthPredictor:
    """Predicts response lengths per prompt from its previous epochs.

    Args:
        history_epochs: appearances of a prompt kept (older ones are forgotten).
        fallback_quantile: quantile of the latest step's lengths used for unseen prompts.
        default_length_tokens: prediction before any step was observed, tokens.

    Raises:
        InvalidInputError: a parameter out of range.
    """

    def __init__(
        self,
        *,
        history_epochs: int = 3,
        fallback_quantile: float = 0.5,
        default_length_tokens: float = 512.0,
    ) -> None:
        if history_epochs < 1:
            raise errors.InvalidInputError("history_epochs", "must be >= 1")
        if not 0.0 <= fallback_quantile <= 1.0:
            raise errors.InvalidInputError("fallback_quantile", "must be within [0, 1]")
        if default_length_tokens < 1:
            raise errors.InvalidInputError("default_length_tokens", "must be >= 1 token")
        self._history_epochs = history_epochs
        self._fallback_quantile = fallback_quantile
        self._default = float(default_length_tokens)
        self._offsets: dict[Hashable, collections.deque[float]] = {}
        self._latest_log_mean: float | None = None
        self._latest_sorted: tuple[float, ...] = ()
        self._log_error: dict[bool, float] = {}

    def observe_step(self, prompt_ids: Sequence[Hashable], lengths_tokens: Sequence[float]) -> None:
        """Record one finished rollout step: response ``i`` answered prompt ``prompt_ids[i]``.

        Several responses of one prompt (a GRPO group) are averaged in log space.

        Raises:
            InvalidInputError: lengths differ from ids, are empty, or a length is < 1.
        """
        if len(prompt_ids) != len(lengths_tokens) or not lengths_tokens:
            raise errors.InvalidInputError(
                "lengths_tokens", "need one length (>= 1 token) per prompt id, at least one"
            )
        logs = []
        for length in lengths_tokens:
            if not length >= 1:
                raise errors.InvalidInputError("lengths_tokens", f"length {length} < 1 token")
            logs.append(math.log(length))
        squared: dict[bool, list[float]] = {True: [], False: []}
        for pred, log_len in zip(self.predict(prompt_ids), logs, strict=True):
            squared[pred.from_history].append((log_len - math.log(pred.length_tokens)) ** 2)
        for kind, errs in squared.items():
            if errs:
                self._log_error[kind] = math.sqrt(sum(errs) / len(errs))
        step_mean = sum(logs) / len(logs)
        per_prompt: dict[Hashable, list[float]] = {}
        for pid, log_len in zip(prompt_ids, logs, strict=True):
            per_prompt.setdefault(pid, []).append(log_len)
        for pid, group in per_prompt.items():
            history = self._offsets.setdefault(pid, collections.deque(maxlen=self._history_epochs))
            history.append(sum(group) / len(group) - step_mean)
        self._latest_log_mean = step_mean
        self._latest_sorted = tuple(sorted(float(x) for x in lengths_tokens))

    def predict(self, prompt_ids: Iterable[Hashable]) -> tuple[LengthPrediction, ...]:
        """Predict the response length of each prompt, in order."""
        fallback = self.fallback_length_tokens()
        out = []
        for pid in prompt_ids:
            history = self._offsets.get(pid)
            if history and self._latest_log_mean is not None:
                offset = sum(history) / len(history)
                length = max(math.exp(self._latest_log_mean + offset), 1.0)
                out.append(LengthPrediction(length, True))
            else:
                out.append(LengthPrediction(fallback, False))
        return tuple(out)

    def log_error_sigma(self, from_history: bool) -> float | None:
        """RMS of ``ln(actual / predicted)`` over the latest step that had such predictions.

        ``from_history`` selects history-based or fallback predictions; with no history-based
        prediction scored yet, the fallback's value stands in. ``None`` before any step.
        """
        if from_history in self._log_error:
            return self._log_error[from_history]
        return self._log_error.get(False)

    def residual(self) -> ResidualLength | None:
        """Remaining-length model from the latest observed step; ``None`` before any step."""
        return ResidualLength(self._latest_sorted) if self._latest_sorted else None

    def fallback_length_tokens(self) -> float:
        """Prediction for an unseen prompt: the quantile of the latest step, tokens."""
        data = self._latest_sorted
        if not data:
            return self._default
        pos = self._fallback_quantile * (len(data) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(data) - 1)
        return data[lo] + (data[hi] - data[lo]) * (pos - lo)
