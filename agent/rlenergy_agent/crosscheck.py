"""Energy cross-check: the energy counter against integrated instant power, per GPU.

Windows and totals come from the energy counter where it works (``rlenergy_agent.energy``); on
some boards the counter and the power sensor disagree by tens of percent, and nothing else would
notice. At a low duty cycle (a ``window_s`` check every ``period_s``: 30 s of every 5 min by
default, one extra NVML read per GPU and sample during the check) ``CrossCheck`` integrates the
instant power (trapezoid over the sampling loop's reads) over the same interval as the counter
delta and compares them. A disagreement above ``threshold`` (default 15 %, the issue's figure)
is a mismatch: the node report carries both numbers (``energyCrossCheck``), the operator posts a
Warning Event with them, ``rlenergy_agent_energy_crosscheck_mismatches_total`` counts it and
``rlenergy_agent_energy_crosscheck_ratio`` exports counter / power of the last check.

Only GPUs metered by the counter are checked (the others integrate power already); a GPU whose
instant power fails is skipped from then on. Pure bookkeeping plus the two reads; the service
calls ``tick`` from the sampling loop. Not thread safe: the service serialises calls.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from rlenergy.gpu import errors
from rlenergy_agent import energy

log = logging.getLogger(__name__)

PERIOD_S = 300.0
WINDOW_S = 30.0
THRESHOLD = 0.15
MIN_ENERGY_J = 50.0
"""Checks with less counter energy than this are not judged (an idle GPU at ~60 W gathers
about 1.8 kJ in 30 s; a failed read leaves too little to compare)."""


@dataclasses.dataclass
class Result:
    """One finished check of one GPU.

    Attributes:
        counter_j: energy from the counter over the check, J.
        power_j: integrated instant power over the same interval, J.
        window_s: length of the check, s.
        mismatch: ``|counter - power| / power`` above the threshold.
    """

    counter_j: float
    power_j: float
    window_s: float
    mismatch: bool

    @property
    def ratio(self) -> float:
        """Counter over power energy."""
        return self.counter_j / self.power_j if self.power_j > 0 else float("inf")


@dataclasses.dataclass
class _Run:
    start_s: float
    start_mj: float
    last_s: float
    last_w: float
    power_j: float = 0.0


@dataclasses.dataclass
class GpuCheck:
    """Per GPU state: the running check, the last result, counts."""

    run: _Run | None = None
    next_s: float = 0.0
    last: Result | None = None
    checks: int = 0
    mismatches: int = 0
    unsupported: bool = False


class CrossCheck:
    """Counter vs integrated instant power (module docstring).

    Args:
        meter: the agent's energy meter (its GPUs and running counter totals).
        period_s: time from one check's start to the next, s.
        window_s: length of a check, s.
        threshold: relative disagreement that counts as a mismatch.
        clock: monotonic time source, s.
    """

    def __init__(
        self,
        meter: energy.EnergyMeter,
        *,
        period_s: float = PERIOD_S,
        window_s: float = WINDOW_S,
        threshold: float = THRESHOLD,
        clock: Callable[[], float],
    ) -> None:
        if not 0 < window_s <= period_s:
            raise ValueError(f"need 0 < window_s <= period_s, got {window_s}, {period_s}")
        self.meter = meter
        self.period_s = period_s
        self.window_s = window_s
        self.threshold = threshold
        self._clock = clock
        self.gpus: dict[str, GpuCheck] = {}

    def tick(self) -> list[str]:
        """Advance every GPU's check by one sample; returns UUIDs whose check just mismatched."""
        now = self._clock()
        found: list[str] = []
        for uuid, st in self.meter.state.items():
            if st.source != "counter" or st.lost_at is not None:
                continue
            chk = self.gpus.setdefault(uuid, GpuCheck(next_s=now))
            if chk.unsupported or (chk.run is None and now < chk.next_s):
                continue
            try:
                power_w = self.meter.gpus[uuid].instant_power_mw() / 1000.0
            except errors.GpuNotSupportedError:
                chk.unsupported = True
                chk.run = None
                continue
            except errors.GpuError as exc:
                log.debug("cross-check power read on %s failed: %s", uuid, exc)
                chk.run = None  # start again next period
                chk.next_s = now + self.period_s
                continue
            self.meter.sample([uuid])
            total_mj = st.total_mj
            if chk.run is None:
                chk.run = _Run(now, total_mj, now, power_w)
                continue
            run = chk.run
            run.power_j += (run.last_w + power_w) / 2.0 * max(now - run.last_s, 0.0)
            run.last_s, run.last_w = now, power_w
            if now - run.start_s >= self.window_s:
                if self._finish(uuid, chk, (total_mj - run.start_mj) / 1000.0, now):
                    found.append(uuid)
        return found

    def _finish(self, uuid: str, chk: GpuCheck, counter_j: float, now: float) -> bool:
        run = chk.run
        assert run is not None
        chk.run = None
        chk.next_s = run.start_s + self.period_s
        if counter_j < MIN_ENERGY_J or run.power_j <= 0:
            return False
        mismatch = abs(counter_j - run.power_j) / run.power_j > self.threshold
        chk.last = Result(counter_j, run.power_j, now - run.start_s, mismatch)
        chk.checks += 1
        if mismatch:
            chk.mismatches += 1
            log.warning(
                "GPU %s: energy counter %.1f J vs integrated instant power %.1f J over %.0f s "
                "(%+.0f %%)",
                uuid,
                counter_j,
                run.power_j,
                now - run.start_s,
                100.0 * (counter_j / run.power_j - 1.0),
            )
        return mismatch
