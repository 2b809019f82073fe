"""Turn an ``RLEnergyPolicySpec`` and a GPU's clock table into EE-RL settings.

Shared by the simulator CLI and the operator, so both read a policy the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlenergy import errors
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.control.freq import candidates, eerl


def phase_settings(
    spec: api_policy.RLEnergyPolicySpec, supported_mhz: Sequence[int]
) -> list[eerl.PhaseSettings]:
    """Per-phase settings with candidates checked against ``supported_mhz``.

    Raises:
        InvalidInputError: a candidate or range the GPU does not support, naming the phase field.
    """
    supported = tuple(sorted(set(supported_mhz), reverse=True))
    out: list[eerl.PhaseSettings] = []
    for i, ph in enumerate(spec.phases):
        try:
            if ph.clock_candidates_mhz is not None:
                cands = candidates.validate_explicit(supported, ph.clock_candidates_mhz)
            elif ph.clock_range_mhz is not None:
                cands = candidates.from_range(
                    supported, ph.clock_range_mhz.min_mhz, ph.clock_range_mhz.max_mhz, ph.step_mhz
                )
            else:
                cands = candidates.thin_candidates(supported)
        except errors.InvalidInputError as exc:
            raise errors.InvalidInputError(f"spec.phases[{i}].{exc.field}", exc.reason) from None
        cands = tuple(c for c in cands if c < supported[0]) or cands
        if ph.clock_candidates_mhz is not None:
            allowed = cands
        elif ph.clock_range_mhz is not None:
            rng = ph.clock_range_mhz
            allowed = tuple(c for c in supported if rng.min_mhz <= c <= rng.max_mhz)
        else:
            allowed = tuple(c for c in supported if c >= min(cands))
        out.append(
            eerl.PhaseSettings(
                name=ph.name,
                min_throughput_ratio=ph.min_throughput_ratio,
                candidates_mhz=cands,
                supported_mhz=supported,
                max_clock_mhz=supported[0],
                allowed_mhz=allowed,
            )
        )
    return out


def controller_settings(spec: api_policy.RLEnergyPolicySpec) -> eerl.ControllerSettings:
    """Controller settings from ``spec.controller``, ``spec.mode`` and ``spec.phaseSource``."""
    c = spec.controller
    return eerl.ControllerSettings(
        enforce=c.mode == "enforce",
        warmup_steps=c.warmup_steps,
        trial_steps=c.trial_steps,
        drift_threshold=c.drift_threshold,
        max_trial_fraction=c.max_trial_fraction,
        async_mode=spec.mode == "async",
        in_phase_probes=spec.phase_source == "socket",
    )


def build_controller(
    spec: api_policy.RLEnergyPolicySpec, supported_mhz: Sequence[int]
) -> eerl.EERLController:
    """An ``EERLController`` for ``spec`` on GPUs with ``supported_mhz``."""
    return eerl.EERLController(phase_settings(spec, supported_mhz), controller_settings(spec))
