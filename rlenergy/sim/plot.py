"""Plot a simulation: SM clock per phase over steps, and cumulative energy vs default."""

from __future__ import annotations

from pathlib import Path

from rlenergy.sim import report as sim_report


def plot_report(rep: sim_report.SimulationReport, path: Path) -> Path:
    """Write a two-panel PNG to ``path`` and return it.

    Top: the locked SM clock per phase per step (the default governor drawn at the max clock,
    trial steps marked). Bottom: cumulative energy of EE-RL and of the default governor, kJ.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlenergy.gpu import models

    sku = models.get_sku(rep.gpu)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    steps = [r.index for r in rep.results]
    for phase in rep.phases:
        clocks = [r.clocks_mhz.get(phase.name) or sku.max_sm_clock_mhz for r in rep.results]
        ax1.step(
            steps,
            clocks,
            where="post",
            label=f"{phase.name} (oracle {phase.oracle_clock_mhz or 'default'})",
        )
        trial = [s for s, r in zip(steps, rep.results, strict=True) if r.probing.get(phase.name)]
        if trial:
            ax1.scatter(trial, [sku.max_sm_clock_mhz + 20] * len(trial), marker="|", s=40)
    ax1.set_ylabel("SM clock (MHz)")
    ax1.set_title(f"EE-RL on {rep.trace} ({rep.gpu}, {rep.mode}): | = probe step")
    ax1.legend(loc="lower left")
    ax1.grid(alpha=0.3)
    online_kj: list[float] = []
    default_kj: list[float] = []
    acc_o = acc_d = 0.0
    for r, (_, e_default) in zip(rep.results, rep.default_steps, strict=True):
        acc_o += r.energy_j / 1000.0
        acc_d += e_default / 1000.0
        online_kj.append(acc_o)
        default_kj.append(acc_d)
    ax2.plot(steps, default_kj, label="default governor")
    ax2.plot(steps, online_kj, label=f"EE-RL (saving {rep.online_saving:.1%})")
    ax2.set_xlabel("RL step")
    ax2.set_ylabel("cumulative GPU energy (kJ)")
    ax2.legend(loc="upper left")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
