"""A verl-style trainer callback that signals phases to the node agent.

verl's PPO loop runs, per step: rollout (generation), then old-log-prob / reference / critic
work and the actor update (training). Call the hooks from the trainer's loop (or a subclass of
its ``RayPPOTrainer.fit``)::

    cb = RLEnergyVerlCallback()
    cb.on_generation_start(step); gen = rollout(...); cb.on_generation_end(step, gen_batch)
    cb.on_training_start(step); update(...); cb.on_step_end(step, metrics)

``on_step_end`` reads verl's metric names (``response_length/mean``, ``prompt_length/mean``,
``batch_size``); valid tokens are the response tokens of samples with a non-zero mask unless the
trainer passes ``valid_tokens`` explicitly. Callers: trainer code.
"""

from __future__ import annotations

from collections.abc import Mapping

from rlenergy.sdk import trainer


class RLEnergyVerlCallback:
    """Phase hooks for a verl-style PPO/GRPO loop.

    Args:
        client: the agent client (default: a new ``RLEnergyClient``).
    """

    def __init__(self, client: trainer.RLEnergyClient | None = None) -> None:
        self.client = client or trainer.RLEnergyClient()

    def on_generation_start(self, step: int) -> None:
        """Rollout begins."""
        self.client.phase("generation", step=step)

    def on_generation_progress(self, decoded_tokens: float) -> None:
        """Tokens decoded since the last call (rollout progress)."""
        self.client.progress(decoded_tokens)

    def on_phase_progress(self, done: float) -> None:
        """Cumulative work of the current phase so far.

        Decode iterations in rollout, trained tokens in the update; call every few tens of ms
        and right before the phase ends (probe slices interpolate it).
        """
        self.client.progress_total(done)

    def on_generation_end(self, step: int) -> None:
        """Rollout done; the GPUs wait (reward, data movement) until training starts."""
        self.client.phase("idle", step=step)

    def on_training_start(self, step: int) -> None:
        """Log-prob, reference, critic and actor update begin."""
        self.client.phase("training", step=step)

    def on_step_end(
        self, step: int, metrics: Mapping[str, float], *, valid_tokens: float | None = None
    ) -> None:
        """Close the step with its token workload from verl's metrics.

        Args:
            step: RL step.
            metrics: verl's step metrics (``batch_size``, ``response_length/mean``,
                ``prompt_length/mean``, optional ``response_length/clip_ratio``).
            valid_tokens: valid tokens when the trainer knows them better.
        """
        samples = int(metrics.get("batch_size", 0))
        response = float(metrics.get("response_length/mean", 0.0)) * samples
        prompt = float(metrics.get("prompt_length/mean", 0.0)) * samples
        clipped = float(metrics.get("response_length/clip_ratio", 0.0))
        valid = valid_tokens if valid_tokens is not None else response * (1.0 - clipped)
        self.client.phase("idle", step=step)
        self.client.end_step(
            step,
            samples=samples,
            response_tokens=response,
            prompt_tokens=prompt,
            valid_tokens=valid,
            mean_context_tokens=(response + prompt) / samples if samples else 0.0,
        )
