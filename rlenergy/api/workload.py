"""Token workload of one RL step, as the trainer-side SDK reports it.

The EE-RL default-governor model is a function of this workload (warm-up, step 2 of the module
docstring of ``rlenergy.control.freq.eerl``), so steps with different response lengths become
comparable.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TokenWorkload:
    """What one RL step processed.

    Attributes:
        samples: samples that reach the training update.
        response_tokens: all generated response tokens (valid or not).
        prompt_tokens: prompt tokens of the trained samples.
        valid_tokens: response tokens of samples that reach the update.
        mean_context_tokens: mean context length during decode (prompt + half the response).
    """

    samples: int
    response_tokens: float
    prompt_tokens: float
    valid_tokens: float
    mean_context_tokens: float

    def phase_tokens(self, phase: str) -> float:
        """Tokens a phase processes: generation decodes responses, training reads all tokens."""
        if phase == "generation":
            return self.response_tokens
        return self.prompt_tokens + self.response_tokens
