"""Phase hooks for a hand-written verl-style loop (a custom driver that holds the GPUs).

A verl job run by ``verl.trainer.main_ppo`` needs none of this: one setting installs
``rlenergy.sdk.verl_hook`` in verl's own worker processes (docs/verl.md). A loop of one's own
calls the same steps itself::

    cb = RLEnergyVerlCallback()
    cb.on_generation_start(step); gen = rollout(...); cb.on_generation_end(step)
    cb.on_training_start(step); update(batch)
    metrics.update(cb.on_step_end(step, verl_hook.trained_batch(batch)))

``on_step_end`` takes the workload of the batch that reached the update
(``rlenergy.sdk.verl_hook.trained_batch``: valid tokens are the response tokens under
``response_mask`` of its samples) and returns the step's ``rlenergy/*`` metrics (tokens, and
the energy per phase the agent metered). Callers: trainer code, the demo's trainers
(``rlenergy_dev.fullstack``, ``podtrainer``).
"""

from __future__ import annotations

from rlenergy.sdk import trainer, verl_hook


class RLEnergyVerlCallback:
    """Phase hooks for a verl-style PPO/GRPO loop.

    Args:
        client: the agent client (default: a new ``RLEnergyClient``).
    """

    def __init__(self, client: trainer.RLEnergyClient | None = None) -> None:
        self.client = client or trainer.RLEnergyClient()
        self._hook = verl_hook.VerlHook(self.client, signals=True)

    def on_generation_start(self, step: int) -> None:
        """Rollout begins."""
        self._hook.enter("generation", step)

    def on_generation_progress(self, decoded_tokens: float) -> None:
        """Tokens decoded since the last call (rollout progress)."""
        self.client.progress(decoded_tokens)

    def on_phase_progress(self, done: float, *, measured_at_s: float | None = None) -> None:
        """Cumulative work of the current phase so far.

        Decode iterations in rollout, trained tokens in the update; call every few tens of ms
        and right before the phase ends (probe slices interpolate it). ``measured_at_s``: when
        ``done`` was counted (``time.monotonic()``; ``None``: now), see
        ``RLEnergyClient.progress_total``.
        """
        self.client.progress_total(done, measured_at_s=measured_at_s)

    def on_generation_end(self, step: int) -> None:
        """Rollout done; the GPUs wait (reward, data movement) until training starts."""
        self._hook.enter("idle", step)

    def on_training_start(self, step: int) -> None:
        """Log-prob, reference, critic and actor update begin."""
        self._hook.enter("training", step)

    def on_step_end(self, step: int, workload: verl_hook.TrainedBatch) -> dict[str, float]:
        """Close step ``step`` with the workload of the batch that reached the update.

        Args:
            step: RL step.
            workload: ``verl_hook.trained_batch(batch)`` of the updated batch.

        Returns:
            The step's ``rlenergy/*`` metrics, to merge into verl's metrics dict.
        """
        self._hook.step = step
        return self._hook.end_step(workload)
