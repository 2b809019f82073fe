"""A test client that plays an RL job on the simulator for 3 fake nodes and produces the
``NodeReport``s their agents would write.

``SimNodes.run(plan_for)`` replays the job; before each step it asks ``plan_for(step)`` for the
operator's published ``ClockPlan`` (the unit tests answer from a ``JobLoop``, the e2e test waits
for ``status.plan`` on the API server) and after each step it splits the job-level measurement
into one ``StepRecord`` per node (each node meters its own 8 GPUs: energy and progress split
evenly, durations shared) and hands the reports to ``publish``.
"""

from __future__ import annotations

from collections.abc import Callable

from rlenergy.api import node as api_node
from rlenergy.control.freq import aggregate, base
from rlenergy.gpu import models
from rlenergy.sim import job as sim_job
from rlenergy.sim import workload

NODES = ("kwok-gpu-0", "kwok-gpu-1", "kwok-gpu-2")
GPUS_PER_NODE = 8


plan_to_decisions = aggregate.plan_decisions


class _PlanPolicy:
    """A ``FrequencyPolicy`` that follows the operator's plan and reports each step."""

    def __init__(self, owner: SimNodes, plan_for: Callable[[int], api_node.ClockPlan]) -> None:
        self.owner = owner
        self.plan_for = plan_for

    def decide(self, step: int) -> base.Plan:
        return plan_to_decisions(self.plan_for(step))

    def observe(self, observation: base.StepObservation) -> None:
        self.owner.record(observation)


class SimNodes:
    """Three simulated nodes of 8 GPUs running one synthetic RL job.

    Args:
        policy_name: the policy the reports belong to.
        steps: RL steps to play.
        publish: called with every node's report after each step.
        window: step records each report keeps (the agent's bound).
    """

    def __init__(
        self,
        policy_name: str,
        steps: int,
        publish: Callable[[list[api_node.NodeReport]], None],
        *,
        window: int = 512,
        seed: int = 3,
    ) -> None:
        self.policy_name = policy_name
        self.sku = models.get_sku("h100-sxm")
        replay = workload.synthetic(steps, seed=seed, num_gpus=len(NODES) * GPUS_PER_NODE)
        self.job = sim_job.Job(replay, self.sku, "sync", seed=seed)
        self.publish = publish
        self.window = window
        self.records: dict[str, list[api_node.StepRecord]] = {n: [] for n in NODES}

    def gpus(self, node: str) -> list[api_node.GpuStatus]:
        clocks = list(self.sku.supported_sm_clocks_mhz())
        return [
            api_node.GpuStatus(
                uuid=f"GPU-{node}-{i:02d}",
                name="NVIDIA H100 80GB HBM3",
                supported_clocks_mhz=clocks,
            )
            for i in range(GPUS_PER_NODE)
        ]

    def record(self, obs: base.StepObservation) -> None:
        n = len(NODES)
        w = obs.workload
        phases = []
        for ph in obs.phases.values():
            phases.append(
                api_node.PhaseWindowReport(
                    phase=ph.phase,
                    duration_seconds=ph.duration_s,
                    energy_joules=None if ph.energy_j is None else ph.energy_j / n,
                    requested_clock_mhz=ph.requested_clock_mhz,
                    applied_clock_mhz=ph.applied_clock_mhz,
                    slowdown=ph.slowdown,
                    slices=[
                        api_node.SliceReport(
                            clock_mhz=s.clock_mhz,
                            duration_seconds=s.duration_s,
                            progress=s.progress / n,
                            energy_joules=None if s.energy_j is None else s.energy_j / n,
                        )
                        for s in ph.slices
                    ],
                    error=ph.error,
                    # The simulator knows each slice's progress exactly (no report gaps).
                    progress_mean_gap_seconds=ph.progress_gap_s,
                )
            )
        rec = api_node.StepRecord(
            step=obs.step,
            workload=api_node.TokenWorkloadReport(
                samples=w.samples,
                response_tokens=w.response_tokens,
                prompt_tokens=w.prompt_tokens,
                valid_tokens=w.valid_tokens,
                mean_context_tokens=w.mean_context_tokens,
            ),
            phases=phases,
            idle_energy_joules=0.0,
        )
        for node in NODES:
            self.records[node] = [*self.records[node], rec][-self.window :]
        self.publish(self.reports())

    def reports(self) -> list[api_node.NodeReport]:
        out = []
        for node in NODES:
            recs = self.records[node]
            out.append(
                api_node.NodeReport(
                    policy_name=self.policy_name,
                    node_name=node,
                    gpus=self.gpus(node),
                    steps=recs,
                    last_step=recs[-1].step if recs else -1,
                    measured_joules_total=sum(
                        p.energy_joules or 0.0 for r in recs for p in r.phases
                    ),
                )
            )
        return out

    def run(self, plan_for: Callable[[int], api_node.ClockPlan]) -> None:
        # Like the agent (rlenergy_agent.__main__), every node reports its GPUs before the
        # first step: the operator counts a step complete over the nodes it can see, so a node
        # whose report first appears with step 0 could otherwise miss that step (a LIST between
        # two creates of the same publish).
        self.publish(self.reports())
        sim_job.run_job(self.job, _PlanPolicy(self, plan_for))
