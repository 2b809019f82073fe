"""Pure formatting of ``kubectl rlenergy status``: policy and node-report objects -> rich tables.

No Kubernetes client and no I/O here: the functions take the objects as the API returns them
(plain dicts, as ``kubectl get -o json`` shows them) and return rich renderables, so the output
is unit-tested with constructed objects (``tests/unit/kubectl``). The API reads live in
``rlenergy_kubectl.kube``.

Conventions: an absent number is shown as ``—`` (unknown), never as 0; clocks are MHz, a phase
without a clock runs the default governor (``default``); energies are joules with an SI prefix.
Node health follows the operator's rule (``rlenergy.control.freq.aggregate.node_ready``): a node
is ready when at least one of its GPUs still measures energy.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic
from rich import box
from rich.console import Group, JustifyMethod, RenderableType
from rich.table import Table
from rich.text import Text

from rlenergy.api import naming
from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy.control.freq import aggregate

UNKNOWN = "—"
"""How an absent (unknown) value is shown."""


@dataclasses.dataclass(frozen=True)
class PolicyView:
    """One ``RLEnergyPolicy`` as the plugin shows it.

    Attributes:
        namespace: the policy's namespace.
        name: the policy's name.
        generation: ``metadata.generation`` (0 when absent).
        controller_mode: ``spec.controller.mode`` (``enforce`` or ``observe``).
        mode: ``spec.mode`` (``sync`` or ``async``).
        status: the parsed status (empty when the operator has not written one).
        status_error: why the status could not be parsed, or ``""``.
        deleting: the object has a ``deletionTimestamp``.
    """

    namespace: str
    name: str
    generation: int
    controller_mode: str
    mode: str
    status: api_status.RLEnergyPolicyStatus
    status_error: str = ""
    deleting: bool = False


@dataclasses.dataclass(frozen=True)
class ReportsView:
    """The node reports of one policy.

    Attributes:
        reports: parsed ``RLEnergyNodeReport`` specs, sorted by node name.
        invalid: ``name: first validation error`` of reports whose spec did not parse.
    """

    reports: tuple[api_node.NodeReport, ...]
    invalid: tuple[str, ...] = ()


def parse_policy(obj: Mapping[str, Any]) -> PolicyView:
    """Read a policy object (a dict as the API returns it).

    An unreadable status does not raise: it is shown with its first validation error.
    """
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    controller = spec.get("controller") or {}
    status_error = ""
    try:
        status = api_status.RLEnergyPolicyStatus.model_validate(
            naming.printable_tree(obj.get("status") or {})
        )
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        status_error = f"status.{where}: {err['msg']}"
        status = api_status.RLEnergyPolicyStatus()
    return PolicyView(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        generation=int(meta.get("generation") or 0),
        controller_mode=str(controller.get("mode", "enforce")),
        mode=str(spec.get("mode", "sync")),
        status=status,
        status_error=status_error,
        deleting=bool(meta.get("deletionTimestamp")),
    )


def parse_reports(items: Sequence[Mapping[str, Any]]) -> ReportsView:
    """Read ``RLEnergyNodeReport`` objects (dicts); invalid specs are listed, not raised."""
    reports: list[api_node.NodeReport] = []
    invalid: list[str] = []
    for item in items:
        try:
            spec = naming.printable_tree(item.get("spec") or {})
            reports.append(api_node.NodeReport.model_validate(spec))
        except pydantic.ValidationError as exc:
            name = (item.get("metadata") or {}).get("name", "?")
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            invalid.append(f"{name}: spec.{where}: {err['msg']}")
    return ReportsView(tuple(sorted(reports, key=lambda r: r.node_name)), tuple(invalid))


# ----- numbers ---------------------------------------------------------------------------------
def fmt_clock(mhz: int | None) -> str:
    """``1410 MHz``, or ``default`` (the default governor) for ``None``."""
    return "default" if mhz is None else f"{mhz} MHz"


def fmt_ratio(value: float | None) -> str:
    """A throughput ratio with 3 decimals (``0.962``), ``—`` when unknown."""
    return UNKNOWN if value is None else f"{value:.3f}"


def fmt_percent(value: float | None) -> str:
    """A percentage with one decimal (``12.3 %``), ``—`` when unknown."""
    return UNKNOWN if value is None else f"{value:.1f} %"


def fmt_saving(value: float | None, low: float | None, high: float | None) -> str:
    """A saving with the range its evidence allows: ``12.3 % (10.1..13.0)``.

    The range is left out where unknown or narrower than the one decimal shown.
    """
    if value is None or low is None or high is None or round(high - low, 1) == 0:
        return fmt_percent(value)
    return f"{value:.1f} % ({low:.1f}..{high:.1f})"


def fmt_joules(value: float | None) -> str:
    """Energy in joules with an SI prefix: ``812 J``, ``45.3 kJ``, ``1.21 MJ``; ``—`` if unknown."""
    if value is None:
        return UNKNOWN
    mag = abs(value)
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if mag >= factor:
            return f"{value / factor:.3g} {prefix}J"
    return f"{value:.3g} J"


def fmt_count(value: float) -> str:
    """A token count with an SI prefix (``1.23 M``)."""
    mag = abs(value)
    for factor, prefix in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if mag >= factor:
            return f"{value / factor:.3g}{prefix}"
    return f"{value:.0f}"


def _table(columns: Sequence[tuple[str, JustifyMethod]], wrap: str = "", title: str = "") -> Table:
    """A table with ``columns`` (header, justification); only the column ``wrap`` may wrap."""
    table = Table(box=box.SIMPLE_HEAD, title=title or None, title_justify="left", expand=False)
    for header, justify in columns:
        table.add_column(header, justify=justify, no_wrap=header != wrap)
    return table


# ----- policy parts ----------------------------------------------------------------------------
def condition_line(status: api_status.RLEnergyPolicyStatus) -> Text:
    """``Ready True (AgentsDeployed) · Progressing ... · Degraded ...`` with messages.

    ``RolloutStalled`` appears only while True (a hung rollout engine).
    """
    out = Text()
    for type_ in api_status.CONDITION_TYPES:
        cond = status.condition(type_)
        if type_ == "RolloutStalled" and (cond is None or cond.status != "True"):
            continue
        if out:
            out.append("  ·  ")
        if cond is None:
            out.append(f"{type_} {UNKNOWN}")
            continue
        bad = (
            (type_ == "Ready" and cond.status == "False")
            or (type_ == "Degraded" and cond.status == "True")
            or type_ == "RolloutStalled"
        )
        out.append(f"{type_} {cond.status}", style="red" if bad else "")
        detail = cond.reason + (f": {cond.message}" if cond.message else "")
        out.append(f" ({detail})")
    return out


def totals_line(status: api_status.RLEnergyPolicyStatus) -> Text:
    """Saving, throughput ratio and step accounting of the job (or that none is known)."""
    t = status.totals
    if t is None:
        return Text("Totals: no complete RL step accounted yet")
    text = (
        f"Saving {fmt_saving(t.saving_percent, t.saving_low_percent, t.saving_high_percent)} "
        f"({fmt_joules(t.saved_joules)} saved of "
        f"{fmt_joules(t.predicted_default_joules)} predicted at the default governor, "
        f"{t.compared_steps} compared steps)  ·  throughput ratio {fmt_ratio(t.throughput_ratio)}"
        f"  ·  steps {t.steps} (through step {t.through_step}, missed {t.missed_steps}, "
        f"energy unknown {t.unknown_energy_steps})  ·  measured {fmt_joules(t.measured_joules)}"
        f"  ·  valid tokens {fmt_count(t.valid_tokens)}"
    )
    return Text(text)


def rollout_line(status: api_status.RLEnergyPolicyStatus) -> Text | None:
    """MoE rollout worker release (FlexFloor), or None for a policy without ``status.rollout``."""
    r = status.rollout
    if r is None:
        return None
    tput = r.tokens_per_occupied_gpu_second
    text = Text(
        f"Rollout (FlexFloor): {r.active} active, {r.released} released, {r.parked_gpus} GPUs "
        f"parked now  ·  released {r.released_gpu_seconds:.1f} GPU-s of "
        f"{r.occupied_gpu_seconds:.1f} occupied  ·  "
        f"tokens / occupied GPU-s {UNKNOWN if tput is None else f'{tput:.4g}'}"
        + ("" if r.floor is None else f"  ·  floor {r.floor} workers")
    )
    if r.scale is not None:
        sc = r.scale
        text.append(
            f"  ·  scale for step {sc.for_step}: {sc.current} -> {sc.target} "
            f"(asked {sc.desired}, {sc.reason})",
            style="red" if sc.reason == "ShrinkRejected" else "",
        )
    return text


def _plan_cell(plan: api_node.ClockPlan | None, phase: str) -> str:
    if plan is None:
        return UNKNOWN
    entry = plan.for_phase(phase)
    if entry is None:
        return UNKNOWN
    if not plan.enforce:
        head = "observe (clocks untouched)" if entry.state == "observe" else "reset to default"
    elif entry.probe_clocks_mhz:
        clocks = ", ".join(fmt_clock(c) for c in entry.probe_clocks_mhz)
        head = f"probe {clocks} ({entry.probe_slice_seconds:g} s slices)"
    else:
        head = fmt_clock(entry.clock_mhz)
    since = "" if entry.since_step is None else f" since step {entry.since_step}"
    return head + since


def phase_table(status: api_status.RLEnergyPolicyStatus) -> Table:
    """Per-phase clocks, throughput ratio against the threshold, saving and energy per token."""
    table = _table(
        (
            ("Phase", "left"),
            ("State", "left"),
            ("Clock", "right"),
            ("Plan", "left"),
            ("Tput ratio", "right"),
            ("Min ratio", "right"),
            ("Saving", "right"),
            ("Saved", "right"),
            ("J / valid token", "right"),
            ("Default J / token", "right"),
            ("Selections", "right"),
        ),
        wrap="Plan",
        title="Phases",
    )
    names = [p.name for p in status.phases]
    if status.plan is not None:
        names += [p.phase for p in status.plan.phases if p.phase not in names]
    for name in names:
        ph = status.phase(name)
        if ph is None:
            table.add_row(name, UNKNOWN, UNKNOWN, _plan_cell(status.plan, name), *[UNKNOWN] * 7)
            continue
        clock = fmt_clock(ph.clock_mhz)
        if ph.recommended_clock_mhz is not None:
            estimate = ph.estimated_saving_percent
            clock += f" (recommends {ph.recommended_clock_mhz} MHz" + (
                ")" if estimate is None else f", [MODEL] est. saving {fmt_percent(estimate)})"
            )
        below = (
            ph.throughput_ratio is not None
            and ph.min_throughput_ratio is not None
            and ph.throughput_ratio < ph.min_throughput_ratio
        )
        table.add_row(
            ph.name,
            ph.state,
            clock,
            _plan_cell(status.plan, name),
            Text(fmt_ratio(ph.throughput_ratio), style="red" if below else ""),
            fmt_ratio(ph.min_throughput_ratio),
            fmt_saving(ph.saving.percent, ph.saving.low_percent, ph.saving.high_percent),
            fmt_joules(ph.saving.joules),
            UNKNOWN
            if ph.energy_per_valid_token_joules is None
            else f"{ph.energy_per_valid_token_joules:.4g}",
            UNKNOWN
            if ph.predicted_default_energy_per_valid_token_joules is None
            else f"{ph.predicted_default_energy_per_valid_token_joules:.4g}",
            str(ph.selections),
        )
    return table


def _gpu_counts(report: api_node.NodeReport) -> str:
    counts = collections.Counter(gpu.condition for gpu in report.gpus)
    order: tuple[api_node.GpuCondition, ...] = ("ok", "measureOnly", "degraded", "lost")
    return ", ".join(f"{counts[c]} {c}" for c in order if c in counts) or "no GPUs"


def _locks(report: api_node.NodeReport) -> str:
    counts = collections.Counter(gpu.locked_clock_mhz for gpu in report.gpus)
    if not counts:
        return UNKNOWN
    keys = sorted(counts, key=lambda k: (k is None, k or 0))
    return ", ".join(f"{fmt_clock(k)} x{counts[k]}" for k in keys)


def _problems(report: api_node.NodeReport) -> str:
    out = [
        f"{g.uuid} {g.condition}" + (f": {g.reason}" if g.reason else "")
        for g in report.gpus
        if g.condition != "ok"
    ]
    if not aggregate.node_ready(report):
        out.insert(0, "no GPU measures energy")
    return "; ".join(out)


def node_table(reports: ReportsView) -> Table:
    """Per-node health from the node reports: GPU conditions, locks, last step, energy."""
    table = _table(
        (
            ("Node", "left"),
            ("Ready", "left"),
            ("GPUs", "left"),
            ("Locked clocks", "left"),
            ("Last step", "right"),
            ("Energy", "right"),
            ("Unattributed", "right"),
            ("Problems", "left"),
        ),
        wrap="Problems",
        title="Nodes",
    )
    for rep in reports.reports:
        ready = aggregate.node_ready(rep)
        table.add_row(
            rep.node_name,
            Text("yes" if ready else "no", style="" if ready else "red"),
            _gpu_counts(rep),
            _locks(rep),
            str(rep.last_step) if rep.last_step >= 0 else UNKNOWN,
            fmt_joules(rep.measured_joules_total),
            fmt_joules(rep.unattributed_joules_total),
            _problems(rep),
        )
    return table


def render_policy(policy: PolicyView, reports: ReportsView) -> RenderableType:
    """The detailed view of one policy: header, conditions, totals, phases, nodes."""
    st = policy.status
    head = Text(f"{policy.namespace}/{policy.name}", style="bold")
    head.append(f"  mode {policy.controller_mode} ({policy.mode})")
    observed = UNKNOWN if st.observed_generation is None else str(st.observed_generation)
    head.append(f"  ·  generation {policy.generation}, observed {observed}")
    if policy.deleting:
        head.append("  ·  being deleted (clocks resetting)", style="yellow")
    parts: list[RenderableType] = [head]
    if policy.status_error:
        parts.append(Text(f"status unreadable: {policy.status_error}", style="red"))
    parts += [condition_line(st), totals_line(st)]
    rollout = rollout_line(st)
    if rollout is not None:
        parts.append(rollout)
    parts.append(phase_table(st))
    nodes = st.nodes
    summary = (
        f"{nodes.ready}/{nodes.total} ready (operator), " if nodes is not None else ""
    ) + f"{len(reports.reports)} node reports"
    parts.append(Text(f"Node agents: {summary}"))
    if reports.reports:
        parts.append(node_table(reports))
    else:
        parts.append(Text("No RLEnergyNodeReport for this policy yet (no agent has reported)."))
    if nodes is not None and nodes.errors:
        errs = "; ".join(
            f"{e.node}{'/' + e.gpu if e.gpu else ''} {e.reason}"
            + (f": {e.message}" if e.message else "")
            for e in nodes.errors
        )
        parts.append(Text(f"Errors (status.nodes.errors): {errs}", style="red"))
    for bad in reports.invalid:
        parts.append(Text(f"unreadable node report {bad}", style="red"))
    return Group(*parts)


def _phase_clocks(status: api_status.RLEnergyPolicyStatus) -> str:
    if not status.phases:
        return UNKNOWN
    return ", ".join(f"{p.name} {fmt_clock(p.clock_mhz)}" for p in status.phases)


def _cond_cell(status: api_status.RLEnergyPolicyStatus, type_: api_status.ConditionType) -> str:
    cond = status.condition(type_)
    return UNKNOWN if cond is None else f"{cond.status} ({cond.reason})"


def summary_table(rows: Sequence[tuple[PolicyView, ReportsView]]) -> Table:
    """One row per policy: clocks per phase, saving, throughput ratio, node health, conditions."""
    table = _table(
        (
            ("Namespace", "left"),
            ("Policy", "left"),
            ("Mode", "left"),
            ("Clocks", "left"),
            ("Saving", "right"),
            ("Tput ratio", "right"),
            ("Nodes ready", "right"),
            ("GPU problems", "right"),
            ("Ready", "left"),
            ("Degraded", "left"),
        ),
        wrap="Clocks",
    )
    for policy, reports in rows:
        st = policy.status
        totals = st.totals
        ready_nodes = sum(1 for r in reports.reports if aggregate.node_ready(r))
        problems = sum(1 for r in reports.reports for g in r.gpus if g.condition != "ok")
        table.add_row(
            policy.namespace,
            policy.name,
            policy.controller_mode,
            _phase_clocks(st),
            UNKNOWN
            if totals is None
            else fmt_saving(
                totals.saving_percent, totals.saving_low_percent, totals.saving_high_percent
            ),
            fmt_ratio(None if totals is None else totals.throughput_ratio),
            f"{ready_nodes}/{len(reports.reports)}",
            str(problems),
            _cond_cell(st, "Ready"),
            _cond_cell(st, "Degraded"),
        )
    return table
