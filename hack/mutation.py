"""Mutation testing of the core with mutmut (pinned in the ``dev`` extra): ``make mutation``.

Each listed module runs on its own, in a scratch copy of the sources (``build/mutation/KEY``),
against the unit tests that exercise it (never the e2e suite), so the runs can be split and
resumed: ``python hack/mutation.py run [KEY ...]`` mutates and tests, ``report`` folds every
finished run into ``build/mutation/report.md`` (the per-file table and each surviving mutant's
diff). ``docs/mutation.md`` is that report as committed, with the survivors explained.

mutmut 3 mutates code inside functions (module-level constants are left alone), runs the tests
that cover the mutated function (it records coverage per test once), and marks a mutant
*killed* when a test fails, *survived* when all pass, *no tests* when none covers it and
*timeout* past 15 x the clean run's time. The score here is killed / (killed + survived +
no tests); timeouts count as killed, as mutmut's own badge counts them.

Options: ``--jobs N`` (mutmut's ``--max-children``, default 2: the machine is shared),
``--only PATTERN`` (a mutmut mutant-name pattern such as
``rlenergy.control.freq.eerl.x_estimate*``, to run part of a module; the report says so).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "mutation"

MODULES: dict[str, tuple[list[str], list[str]]] = {
    "control-freq": (
        ["rlenergy/control/freq/*.py"],
        [
            "tests/unit/control/freq",
            "tests/unit/operator/test_aggregate.py",
            "tests/unit/operator/test_jobloop_truth.py",
        ],
    ),
    "control-freq-units": (
        ["rlenergy/control/freq/predictor.py", "rlenergy/control/freq/candidates.py"],
        ["tests/unit/control/freq/test_predictor.py", "tests/unit/control/freq/test_candidates.py"],
    ),
    "control-freq-rest": (
        [
            "rlenergy/control/freq/aggregate.py",
            "rlenergy/control/freq/base.py",
            "rlenergy/control/freq/config.py",
            "rlenergy/control/freq/candidates.py",
            "rlenergy/control/freq/predictor.py",
        ],
        [
            "tests/unit/control/freq/test_predictor.py",
            "tests/unit/control/freq/test_candidates.py",
            "tests/unit/control/freq/test_candidate_picks.py",
            "tests/unit/control/freq/test_eerl_checks.py",
            "tests/unit/operator/test_aggregate.py",
            "tests/unit/operator/test_aggregate_fields.py",
            "tests/unit/control/freq/test_freq_base.py",
            "tests/unit/control/freq/test_freq_config.py",
            "tests/unit/control/freq/test_default_governor_edges.py",
            "tests/unit/operator/test_jobloop.py",
            "tests/unit/operator/test_jobloop_accounting.py",
            "tests/unit/operator/test_jobloop_status.py",
            "tests/unit/operator/test_jobloop_totals.py",
        ],
    ),
    "control-freq-probe": (
        ["rlenergy/control/freq/probe.py"],
        [
            "tests/unit/control/freq/test_probe.py",
            "tests/unit/control/freq/test_corrected_fit.py",
            "tests/unit/control/freq/test_probe_stats.py",
            "tests/unit/control/freq/test_probe_blocks.py",
            "tests/unit/control/freq/test_fit_bias.py",
            "tests/unit/control/freq/test_predictor.py",
        ],
    ),
    "control-freq-eerl": (
        ["rlenergy/control/freq/eerl.py"],
        [
            "tests/unit/control/freq/test_eerl.py",
            "tests/unit/control/freq/test_eerl_checks.py",
            "tests/unit/control/freq/test_eerl_ledger.py",
            "tests/unit/control/freq/test_eerl_search.py",
            "tests/unit/control/freq/test_eerl_helpers.py",
        ],
    ),
    "control-moe": (["rlenergy/control/moe/*.py"], ["tests/unit/control/moe"]),
    "agent-energy": (
        ["agent/rlenergy_agent/energy.py", "rlenergy/gpu/energy.py"],
        [
            "tests/unit/agent/test_energy_meter.py",
            "tests/unit/agent/test_probe_slices.py",
            "tests/unit/gpu/test_energy.py",
            "tests/unit/gpu/test_counter_delta.py",
            "tests/unit/agent/test_energy_bounds.py",
        ],
    ),
    "gpu-energy": (
        ["rlenergy/gpu/energy.py"],
        ["tests/unit/gpu/test_energy.py", "tests/unit/gpu/test_counter_delta.py"],
    ),
    "agent-actuator": (
        ["agent/rlenergy_agent/actuator.py"],
        [
            "tests/unit/agent/test_actuator.py",
            "tests/unit/agent/test_park.py",
            "tests/unit/agent/test_caps.py",
            "tests/unit/agent/test_actuator_faults.py",
        ],
    ),
    "agent-callers": (
        ["agent/rlenergy_agent/identity.py"],
        ["tests/unit/agent/test_identity.py"],
    ),
    "operator-accounting": (
        ["operator/rlenergy_operator/jobloop.py"],
        [
            "tests/unit/operator/test_jobloop.py",
            "tests/unit/operator/test_jobloop_truth.py",
            "tests/unit/operator/test_jobloop_totals.py",
            "tests/unit/operator/test_jobloop_accounting.py",
            "tests/unit/operator/test_reset_plan.py",
            "tests/unit/operator/test_jobloop_status.py",
        ],
    ),
    "sim-scoring": (
        ["rlenergy/sim/job.py"],
        ["tests/unit/sim/test_job.py", "tests/unit/sim/test_job_scoring.py"],
    ),
}
"""Key -> (files to mutate, unit tests to run). Test paths that do not exist are skipped.

``control-freq-units`` mutates two of ``control-freq``'s files against their own function-level
tests only (seconds per mutant instead of the whole simulated jobs of ``test_eerl.py``): its
score is a lower bound of theirs under ``control-freq``, where more tests run. Likewise
``control-freq-probe`` for the probe blocks, the phase model and its correction, and
``control-freq-rest`` for every control-freq file but those two and ``eerl.py``, and
``control-freq-eerl`` for the controller itself against its own tests (``test_eerl*.py``: small
simulated jobs of seconds each)."""

COPIED = {
    "rlenergy": "rlenergy",
    "agent/rlenergy_agent": "rlenergy_agent",
    "operator/rlenergy_operator": "rlenergy_operator",
    "operator/rlenergy_kubectl": "rlenergy_kubectl",
    "dev/rlenergy_dev": "rlenergy_dev",
    "dev/nvml_standin": "nvml_standin",
    "tests": "tests",
    "pyproject.toml": "pyproject.toml",
}
"""Repository path -> path in the scratch copy. mutmut names a mutant after its file's path
from the copy's root, so each package sits at the root there (``agent/rlenergy_agent`` would
make ``agent.rlenergy_agent.energy``, a name no test imports)."""
PACKAGES = ["rlenergy", "rlenergy_agent", "rlenergy_operator", "rlenergy_kubectl"]


def _scratch(path: str) -> str:
    """A repository path as it lies in the scratch copy."""
    for repo, there in COPIED.items():
        if path == repo or path.startswith(repo + "/"):
            return there + path[len(repo) :]
    return path


KILLED = {"killed", "timeout", "caught by type check"}
SCORED = KILLED | {"survived", "no tests"}
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped"}
STATUS.update({36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout"})
STATUS.update({37: "caught by type check", -11: "segfault", -9: "segfault"})


def _repo(path: str) -> str:
    """A scratch-copy path as it lies in the repository."""
    for repo, there in COPIED.items():
        if path == there or path.startswith(there + "/"):
            return repo + path[len(there) :]
    return path


def _mutmut() -> str:
    exe = Path(sys.executable).with_name("mutmut")
    if not exe.exists():
        raise SystemExit(f"{exe} missing: run `make venv` (mutmut is in the dev extra)")
    return str(exe)


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def prepare(key: str, *, keep: bool = False) -> Path:
    """A scratch copy for ``key`` with its ``[tool.mutmut]`` section.

    ``keep``: an earlier run's copy keeps its sources and results; only the tests and the
    configuration are refreshed and mutmut's coverage record dropped (re-collected), so the
    mutants named by ``--only`` are retried against the current tests.
    """
    files, tests = MODULES[key]
    tests = [t for t in tests if (ROOT / t).exists()]
    if not tests:
        raise SystemExit(f"{key}: none of its tests exist")
    work = WORK / key
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "build", ".hypothesis")
    if keep and (work / "mutants").exists():
        for there in ("tests", "pyproject.toml"):
            for base in (work, work / "mutants"):
                target = base / there
                if target.is_dir():
                    shutil.rmtree(target)
        shutil.copytree(ROOT / "tests", work / "tests", ignore=ignore)
        shutil.copy2(ROOT / "pyproject.toml", work / "pyproject.toml")
        (work / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    else:
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        for repo, there in COPIED.items():
            src = ROOT / repo
            if src.is_dir():
                shutil.copytree(src, work / there, ignore=ignore)
            else:
                shutil.copy2(src, work / there)
    section = (
        "\n[tool.mutmut]\n"
        f"source_paths = {_toml_list(PACKAGES)}\n"
        f"only_mutate = {_toml_list([_scratch(f) for f in files])}\n"
        f"also_copy = {_toml_list(['rlenergy_dev', 'nvml_standin'])}\n"
        f"pytest_add_cli_args_test_selection = {_toml_list(tests)}\n"
        f"pytest_add_cli_args = {_toml_list(['-p', 'no:cacheprovider', '-m', 'not e2e'])}\n"
    )
    with (work / "pyproject.toml").open("a") as f:
        f.write(section)
    return work


def run(key: str, jobs: int, only: list[str]) -> None:
    """Mutate ``key``'s files and run its tests; the log goes to ``build/mutation/KEY.log``."""
    work = prepare(key, keep=bool(only))
    log = WORK / f"{key}.log"
    started = time.monotonic()
    with log.open("w") as out:
        cmd = [_mutmut(), "run", "--max-children", str(jobs), *only]
        rc = subprocess.call(cmd, cwd=work, stdout=out, stderr=subprocess.STDOUT)
    summary = collect(key)
    previous = WORK / f"{key}.json"
    runs = _runs(json.loads(previous.read_text())) if only and previous.exists() else []
    runs.append({"rc": rc, "seconds": round(time.monotonic() - started), "only": only})
    summary.update(runs=runs, jobs=jobs)
    (WORK / f"{key}.json").write_text(json.dumps(summary, indent=1))
    counts = summary["files"]
    print(
        f"{key}: rc {rc}, {runs[-1]['seconds']} s; "
        + "; ".join(f"{f} {c['killed']}/{c['scored']}" for f, c in counts.items())
    )


def collect(key: str) -> dict[str, object]:
    """Per file: counts by status and the surviving mutants' diffs."""
    work = WORK / key
    files: dict[str, dict[str, object]] = {}
    survivors: list[dict[str, str]] = []
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        rel = _repo(str(meta.relative_to(work / "mutants"))[: -len(".meta")])
        data = json.loads(meta.read_text())
        codes: dict[str, int | None] = data.get("exit_code_by_key", {})
        by: dict[str, int] = {}
        for name, code in codes.items():
            status = STATUS.get(code, "not checked" if code is None else "suspicious")
            by[status] = by.get(status, 0) + 1
            if status in ("survived", "no tests"):
                survivors.append({"file": rel, "name": name, "status": status})
        killed = sum(v for s, v in by.items() if s in KILLED)
        scored = sum(v for s, v in by.items() if s in SCORED)
        files[rel] = {"mutants": len(codes), "killed": killed, "scored": scored, "by": by}
    sources: dict[str, dict[str, str]] = {}
    for s in survivors:
        path = work / "mutants" / _scratch(s["file"])
        if s["file"] not in sources:
            sources[s["file"]] = _functions(path)
        funcs = sources[s["file"]]
        mangled = s["name"].rsplit(".", 1)[-1]
        orig = funcs.get(mangled.split("__mutmut_")[0] + "__mutmut_orig", "")
        mutant = funcs.get(mangled, "")
        s["diff"] = "\n".join(
            line
            for line in difflib.unified_diff(orig.splitlines(), mutant.splitlines(), lineterm="")
            if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))
        )
    return {"files": files, "survivors": survivors}


def _functions(path: Path) -> dict[str, str]:
    """Source of every function (methods included) in a mutated file, by name."""
    text = path.read_text()
    lines = text.splitlines()
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
            # Compare bodies only: the mutant and the original differ in their names.
            first = node.body[0].lineno if node.body else node.lineno + 1
            out[node.name] = "\n".join(lines[first - 1 : node.end_lineno])
    return out


def _runs(summary: dict[str, object]) -> list[dict[str, object]]:
    """The runs a summary records (a summary written before retries has one, inline)."""
    runs = summary.get("runs")
    if isinstance(runs, list):
        return runs
    return [{k: summary.get(k) for k in ("rc", "seconds", "only")}]


def report() -> Path:
    """Fold every finished run into ``build/mutation/report.md``."""
    lines = [
        "| module | mutants | killed | score |",
        "| --- | --- | --- | --- |",
    ]
    detail: list[str] = []
    runs: list[str] = []
    for key in MODULES:
        path = WORK / f"{key}.json"
        if not path.exists():
            runs.append(f"* {key}: not run")
            continue
        summary = json.loads(path.read_text())
        for r in _runs(summary):
            only = r.get("only") or []
            runs.append(
                f"* {key}: {r['seconds']} s, {summary['jobs']} workers, rc {r['rc']}"
                + (f", retried {', '.join(only)}" if only else ", every mutant")
            )
        for rel, c in summary["files"].items():
            score = 100.0 * c["killed"] / c["scored"] if c["scored"] else 0.0
            checked = f" ({c['scored']} checked)" if c["scored"] != c["mutants"] else ""
            lines.append(f"| `{rel}` | {c['mutants']}{checked} | {c['killed']} | {score:.1f} |")
        for s in summary["survivors"]:
            detail.append(f"* `{s['name']}` ({s['status']})")
            if s.get("diff"):
                detail += ["", "  ```diff", *("  " + x for x in s["diff"].splitlines()), "  ```"]
    out = WORK / "report.md"
    out.write_text(
        "\n".join(["# Mutation report", "", *runs, "", *lines, "", "## Survivors", "", *detail])
        + "\n"
    )
    print(out)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: ``run [KEY ...]`` and ``report``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("keys", nargs="*", help=f"modules (default: all): {', '.join(MODULES)}")
    r.add_argument("--jobs", type=int, default=2)
    r.add_argument("--only", action="append", default=[])
    c = sub.add_parser("collect", help="re-read finished runs' results (no mutmut run)")
    c.add_argument("keys", nargs="+")
    sub.add_parser("report")
    args = ap.parse_args(argv)
    if args.cmd == "collect":
        for key in args.keys:
            path = WORK / f"{key}.json"
            old = json.loads(path.read_text()) if path.exists() else {}
            summary = collect(key)
            summary.update(runs=_runs(old) if old else [], jobs=old.get("jobs", 2))
            path.write_text(json.dumps(summary, indent=1))
        report()
        return 0
    if args.cmd == "run":
        unknown = [k for k in args.keys if k not in MODULES]
        if unknown:
            ap.error(f"unknown module {unknown}; known: {', '.join(MODULES)}")
        for key in args.keys or list(MODULES):
            run(key, args.jobs, args.only)
        report()
    else:
        report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
