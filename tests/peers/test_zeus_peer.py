"""The real Zeus GlobalPowerLimitOptimizer driven on the simulated GPUs (bench/zeus_sim.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

try:
    import zeus
    import zeus_sim
    from zeus.optimizer.power_limit import MaxSlowdownConstraint
except ModuleNotFoundError as exc:  # pragma: no cover - the message is the fix
    raise RuntimeError(f"{exc}; install the peers extra: make test-peers") from exc

from rlenergy.gpu import models
from rlenergy.sim import job as sim_job
from rlenergy.sim import traces, workload

pytestmark = pytest.mark.peers


def _job(steps: int) -> sim_job.Job:
    sku = models.get_sku("b200")
    trace = traces.load_trace("verl-gpg-qwen2-7b-fsdp-8gpu")
    return sim_job.Job(workload.from_trace(trace, sku, steps), sku, "sync", seed=1)


def test_pinned_zeus_is_the_one_installed() -> None:
    assert zeus.__version__ == zeus_sim.ZEUS_VERSION


def test_zeus_sweeps_power_limits_on_the_simulated_gpus_and_settles() -> None:
    # Short stock-shaped sweep: 1 wait step, then per limit 1 warm-up + 3 profiling steps.
    job = _job(120)
    peer = zeus_sim.ZeusPowerLimitPeer(
        workload.PHASES,
        MaxSlowdownConstraint(factor=1 / 0.95),
        warmup_steps=1,
        profile_steps=3,
        pl_step=100,
    )
    results, gpus = sim_job.run_job(job, peer, on_start=peer.bind)
    assert peer.devices is not None and peer.optimizer is not None
    # Zeus set every limit from 1000 W down to its 200 W constraint on every GPU, then the choice.
    calls = peer.devices.gpus[0].power_limit_calls  # type: ignore[attr-defined]
    assert calls[:9] == [1_000_000 - 100_000 * i for i in range(9)]
    assert peer.state.startswith("Done(")
    chosen_mw = peer.optimizer.state.optimal_power_limit
    assert all(g.power_limit_mw() == chosen_mw for g in gpus)
    # Zeus's own measurements are the simulator's time and counter energy per limit.
    by_limit = {m.power_limit: m for m in peer.optimizer.measurements}
    assert set(by_limit) == {1000 - 100 * i for i in range(9)}
    assert by_limit[200].time > by_limit[1000].time
    # The chosen limit keeps Zeus's slowdown bound on Zeus's own measurements.
    assert by_limit[chosen_mw // 1000].time <= by_limit[1000].time / 0.95
    # After the sweep the job runs under the chosen limit: the truth matches the analytic run.
    tail = results[-20:]
    want = [job.step_truth(job.replay.steps[r.index], {}, chosen_mw / 1000)[0] for r in tail]
    assert [r.time_s for r in tail] == pytest.approx(want, rel=1e-9)
