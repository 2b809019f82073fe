"""The smoke-test trainer: RL steps of two fixed-length phases signalled through the SDK.

``python3 -m rlenergy.sdk.smoke`` runs in the smoke pod (``kubectl rlenergy smoke``,
docs/kubectl-plugin.md). Each step signals ``generation`` for ``--phase-s`` seconds and then
``training`` for as long, reporting the phase's progress every ``PROGRESS_EVERY_S`` as a
constant rate of work per second, and closes the step with a fixed token workload
(``end_step``). It runs no GPU kernel: the phases take the same time at every clock, so the
controller finds the phases insensitive to the clock and locks a low one, and the saving it
reports is the GPUs' power at that clock against the default governor's, for GPUs that idle
(so a real GPU's saving in the smoke test is small: a demonstration of the loop, not of a
job's saving).

Each step prints one line ``step N phaseEnergyJoules {...}`` with the agent's answer to the
step's end (the energy it metered per phase on the pod's GPUs, J). Exit codes: 0 after
``--steps`` steps; 3 when the agent refused a signal (the reason on stderr: most often 401, the
token volume missing, or 403, the pod holds no GPU on that node).

Callers: the smoke pod (``rlenergy_kubectl.smoke.pod``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from rlenergy.sdk import trainer

PHASES = ("generation", "training")
"""The phases of a smoke step, in order (the policy's default phases)."""
PROGRESS_EVERY_S = 0.01
"""Progress report pause, s. The agent's in-phase probe slices are at least 4 report gaps long
(``eerl.SLICE_PER_PROGRESS_GAP``) and a phase needs 8 of them (``probe.BLOCK``); over TLS on a
busy node a report takes about 10 ms more, so 1 s phases keep in-phase trials. With 20 ms
pauses and 0.5 s phases the real-node run fell back to whole-step trials and locked no clock."""
MIN_SLEEP_S = 1e-4
"""A phase with less than this left is over, s (no sleep shorter than the clock resolves)."""
RATE_PER_S = 1000.0
"""Work units (tokens) reported per second of a phase."""
SAMPLES = 64
"""Samples per step in the step's token workload."""
RESPONSE_TOKENS = 64 * 256
"""Response tokens per step (64 samples x 256 tokens)."""
PROMPT_TOKENS = 64 * 128
"""Prompt tokens per step (64 samples x 128 tokens)."""
REFUSED_EXIT = 3
"""Exit code when the agent refused a signal."""
UNAVAILABLE = 503
"""The agent's answer while it cannot check tokens (API server unreachable): retried."""
AGENT_WAIT_S = 120.0
"""How long the pod waits for its node's agent to answer the first signal, s (the agent
DaemonSet starts with the first policy, possibly after the pod)."""


class Client(Protocol):
    """What the smoke loop needs of ``trainer.RLEnergyClient``."""

    def phase(self, name: str, *, step: int) -> object:
        """Enter phase ``name`` of step ``step`` (``idle`` ends the phase)."""

    def progress_total(self, total: float) -> None:
        """The phase's cumulative work so far (tokens)."""

    def end_step(
        self, step: int, *, samples: int, response_tokens: float, prompt_tokens: float,
        valid_tokens: float,
    ) -> dict[str, object]:  # fmt: skip
        """Close step ``step`` with its token workload; the agent's answer."""


def run_steps(
    client: Client,
    steps: int,
    phase_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    echo: Callable[[str], None] = print,
) -> int:
    """Run ``steps`` smoke steps of ``PHASES``, ``phase_s`` seconds each; returns steps done.

    Args:
        client: the SDK client (strict, so a refusal raises ``AgentRefusedError``).
        steps: RL steps to run, >= 1.
        phase_s: length of each phase, s (> 0).
        clock: monotonic time, s.
        sleep: waits, s.
        echo: prints one line per step.

    Raises:
        ValueError: ``steps`` < 1 or ``phase_s`` <= 0.
        trainer.AgentRefusedError: the agent refused a signal.
    """
    if steps < 1 or phase_s <= 0:
        raise ValueError(f"steps must be >= 1 and phase_s > 0, got {steps} and {phase_s}")
    for step in range(steps):
        for name in PHASES:
            client.phase(name, step=step)
            start = clock()
            while (left := phase_s - (clock() - start)) > MIN_SLEEP_S:
                client.progress_total((phase_s - left) * RATE_PER_S)
                sleep(min(PROGRESS_EVERY_S, left))
            client.progress_total(phase_s * RATE_PER_S)
        client.phase("idle", step=step)
        answer = client.end_step(
            step,
            samples=SAMPLES,
            response_tokens=RESPONSE_TOKENS,
            prompt_tokens=PROMPT_TOKENS,
            valid_tokens=RESPONSE_TOKENS,
        )
        energy = answer.get("phaseEnergyJoules") if answer else None
        echo(f"step {step} phaseEnergyJoules {json.dumps(energy, sort_keys=True)}")
    return steps


def wait_for_agent(
    client: Client,
    timeout_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Signal ``idle`` until the agent answers.

    Unreachable (no agent on the node yet, its certificate not yet signed) and 503 (the agent
    could not check the token yet) are retried every second; any other refusal raises at once.

    Raises:
        OSError, http.client.HTTPException: no answer within ``timeout_s`` (the last error).
        trainer.AgentRefusedError: the agent refused (or still answered 503 at the deadline).
    """
    deadline = clock() + timeout_s
    while True:
        try:
            client.phase("idle", step=0)
            return
        except (OSError, http.client.HTTPException, trainer.AgentRefusedError) as exc:
            retry = not isinstance(exc, trainer.AgentRefusedError) or exc.status == UNAVAILABLE
            if not retry or clock() >= deadline:
                raise
            print(f"smoke: agent not answering yet ({exc}); retrying", file=sys.stderr)
            sleep(1.0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m rlenergy.sdk.smoke``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m rlenergy.sdk.smoke", description=__doc__)
    parser.add_argument("--steps", type=int, default=60, help="RL steps to run (default 60)")
    parser.add_argument(
        "--phase-s", type=float, default=1.0, help="length of each phase, s (default 1.0)"
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.phase_s <= 0:
        parser.error("--steps must be >= 1 and --phase-s > 0")
    client = trainer.RLEnergyClient(strict=True, timeout_s=5.0)
    print(f"smoke: signalling {args.steps} steps to the agent at {client.endpoint}", flush=True)
    try:
        wait_for_agent(client, AGENT_WAIT_S)
        run_steps(client, args.steps, args.phase_s, echo=lambda s: print(s, flush=True))
    except trainer.AgentRefusedError as exc:
        print(f"smoke: {exc}", file=sys.stderr)
        return REFUSED_EXIT
    except (OSError, http.client.HTTPException) as exc:
        print(f"smoke: no answer from the agent at {client.endpoint}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
