"""MoE rollout simulator: invariants at every decode step, release rounds, report, CLI.

We test these aspects:
* on random batches both policies complete every response, never leave an expert without an
  active host, never overflow memory (property);
* a rank that misses the ack deadline aborts the round and the group stays whole;
* the lognormal fit reproduces a step's mean; the CLI prints the documented JSON keys and
  refuses bad input with exit code 2;
* a pool of independent replicas: one replica is exactly ``simulate_rollout``; the baseline
  charges every GPU until the slowest replica ends (step barrier), FlexFloor frees a replica
  when its responses are done; invariants hold in every replica (property);
* the prompt-effect generator: persistence across epochs and the per-prompt share behave as
  documented.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlenergy import cli
from rlenergy.sim import moe, rollout_report

MODEL = moe.MOE_MODELS["qwen3-30b-a3b"]


def batch(lengths, prompt=64):
    return moe.RolloutBatch(
        tuple(f"p{i}" for i in range(len(lengths))),
        tuple([prompt] * len(lengths)),
        tuple(int(x) for x in lengths),
    )


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 400), min_size=1, max_size=80),
    workers=st.integers(1, 8),
    noise=st.floats(0.0, 1.0),
    min_active=st.integers(1, 3),
)
def test_property_invariants_hold_every_step(lengths, workers, noise, min_active):
    config = moe.RolloutConfig(
        model=MODEL, workers=workers, min_active_workers=min(min_active, workers)
    )
    rng = np.random.default_rng(len(lengths))
    preds = [max(1.0, x * math.exp(noise * rng.standard_normal())) for x in lengths]
    for policy, p in (("baseline", None), ("flexfloor", preds)):
        r = moe.simulate_rollout(config, batch(lengths), policy=policy, predictions=p)
        assert r.incomplete_responses == 0
        assert r.expert_unavailable_steps == 0
        assert r.memory_overflow_steps == 0
        assert r.tokens == sum(lengths)
        assert r.decode_steps >= max(lengths)
        assert r.active_workers_min >= min(min_active, workers)


def test_tight_memory_forces_preemption_without_overflow():
    # 235B on 16 x H100: little KV room; long responses must queue or be preempted.
    config = moe.RolloutConfig(model=moe.MOE_MODELS["qwen3-235b-a22b"], workers=16)
    lengths = [3000] * 64 + [50] * 64
    r = moe.simulate_rollout(config, batch(lengths, prompt=2000), policy="baseline")
    assert r.memory_overflow_steps == 0 and r.incomplete_responses == 0


def test_flexfloor_releases_finished_workers():
    config = moe.RolloutConfig(model=MODEL, workers=8)
    lengths = [2000] * 8 + [20] * 120
    preds = [float(x) for x in lengths]
    # Concentrated (the long responses on one worker), rule only (no guard, no slowdown
    # allowance): the others finish early and leave.
    r = moe.simulate_rollout(
        config,
        batch(lengths),
        policy="flexfloor",
        predictions=preds,
        placement_mode="length",
        guard=False,
    )
    base = moe.simulate_rollout(config, batch(lengths), policy="baseline")
    assert r.releases_committed >= 1 and r.active_workers_min < 8
    assert r.occupied_gpu_s < base.occupied_gpu_s
    assert r.expert_unavailable_steps == 0
    # Balanced (the default): one long response per worker, so the group's heaviest rank
    # carries less KV than verl's contiguous chunk (all 8 long ones on worker 0).
    bal = moe.simulate_rollout(config, batch(lengths), policy="flexfloor", predictions=preds)
    assert bal.wall_s < base.wall_s and bal.occupied_gpu_s < base.occupied_gpu_s


def test_missed_ack_deadline_aborts_and_group_stays_consistent():
    config = moe.RolloutConfig(model=MODEL, workers=4)
    lengths = [1500] * 4 + [20] * 60
    preds = [float(x) for x in lengths]
    r = moe.simulate_rollout(
        config,
        batch(lengths),
        policy="flexfloor",
        predictions=preds,
        dropped_acks={0: frozenset({0})},
        placement_mode="length",
        guard=False,
    )
    assert r.releases_aborted == 1
    assert r.releases_committed >= 1  # a later round commits
    assert r.expert_unavailable_steps == 0 and r.memory_overflow_steps == 0
    assert r.incomplete_responses == 0


def test_lognormal_fit_matches_the_logged_mean():
    mu, sigma = rollout_report.fit_lognormal(308.0, 1024.0, 5120, 0.036)
    mean = rollout_report._clipped_lognormal_mean(mu, sigma, 1024.0)
    assert mean == pytest.approx(308.0, rel=1e-3)
    assert 0.1 < sigma < 2.0


def test_trace_step_lengths_reads_min_max_and_group():
    steps = rollout_report.trace_step_lengths("verl-gpg-qwen2-7b-fsdp-8gpu")
    assert steps[0].group_size == 5 and steps[0].max_response_tokens == 1024
    assert all(s.min_tokens <= s.mean_tokens <= s.max_tokens for s in steps)
    (row,) = rollout_report.trace_step_lengths("samples:verl3727-qwen3vl-30b-a3b-gspo")
    assert row.max_tokens == 30000 and row.min_tokens == 665


def test_cli_json_keys(capsys):
    code = cli.main(
        [
            "rollout-sim",
            "--trace",
            "verl-ppo-qwen25-7b-gsm8k-16gpu",
            "--workers",
            "4",
            "--experts",
            "128",
            "--steps",
            "2",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "tokens_per_occupied_gpu_s_ratio",
        "generation_throughput_ratio",
        "baseline_idle_after_finish_fraction",
        "expert_unavailable_steps",
        "memory_overflow_steps",
    ):
        assert key in out
    assert out["expert_unavailable_steps"] == 0 and out["memory_overflow_steps"] == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--workers", "0"],
        ["--experts", "2", "--workers", "8"],
        ["--trace", "no-such-trace"],
        ["--model", "qwen3-235b-a22b", "--workers", "2"],
        ["--heavy-tail", "1.5"],
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv, capsys):
    assert cli.main(["rollout-sim", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlenergy: error:") and "\n" not in err


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 600), min_size=1, max_size=60),
    workers=st.integers(1, 8),
    noise=st.floats(0.0, 1.0),
    guard=st.booleans(),
)
def test_property_event_driven_equals_step_by_step(lengths, workers, noise, guard):
    # Advancing quiet decode steps together gives the per-step result (float order aside),
    # invariant counters included.
    config = moe.RolloutConfig(model=MODEL, workers=workers)
    rng = np.random.default_rng(len(lengths) + workers)
    preds = [max(1.0, x * math.exp(noise * rng.standard_normal())) for x in lengths]
    for policy, p in (("baseline", None), ("flexfloor", preds)):
        fine = moe.simulate_rollout(
            config, batch(lengths), policy=policy, predictions=p, guard=guard, coarse=False
        )
        coarse = moe.simulate_rollout(
            config, batch(lengths), policy=policy, predictions=p, guard=guard, coarse=True
        )
        assert coarse.decode_steps == fine.decode_steps
        assert coarse.releases_committed == fine.releases_committed
        assert coarse.expert_unavailable_steps == fine.expert_unavailable_steps == 0
        assert coarse.memory_overflow_steps == fine.memory_overflow_steps == 0
        assert coarse.incomplete_responses == fine.incomplete_responses == 0
        assert coarse.occupied_gpu_s == pytest.approx(fine.occupied_gpu_s, rel=1e-9)
        assert coarse.wall_s == pytest.approx(fine.wall_s, rel=1e-9)
        assert coarse.idle_after_finish_gpu_s == pytest.approx(
            fine.idle_after_finish_gpu_s, rel=1e-9, abs=1e-12
        )


def test_event_driven_preemption_matches_step_by_step():
    # 235B on 16 x H100 with long prompts: KV growth forces preemptions inside quiet spans.
    config = moe.RolloutConfig(model=moe.MOE_MODELS["qwen3-235b-a22b"], workers=16)
    lengths = [3000] * 64 + [50] * 64
    fine = moe.simulate_rollout(config, batch(lengths, 2000), policy="baseline", coarse=False)
    coarse = moe.simulate_rollout(config, batch(lengths, 2000), policy="baseline")
    assert coarse.preemptions == fine.preemptions
    assert coarse.decode_steps == fine.decode_steps
    assert coarse.occupied_gpu_s == pytest.approx(fine.occupied_gpu_s, rel=1e-9)


def test_min_anchored_fit_when_the_max_is_the_limit():
    # verl#3727: mean 11,018, min 665, max = limit 30,000, no clip ratio logged.
    mu, sigma = rollout_report.fit_lognormal(
        11018.0, 30000.0, 1024, None, min_tokens=665.0, limit_tokens=30000.0
    )
    assert rollout_report._clipped_lognormal_mean(mu, sigma, 30000.0) == pytest.approx(
        11018.0, rel=1e-3
    )
    z = rollout_report.statistics.NormalDist().inv_cdf(1 - 1 / 1025)
    assert math.exp(mu - z * sigma) == pytest.approx(665.0, rel=1e-6)


def test_calibrated_scenario_runs_fast_with_zero_violations():
    config = moe.RolloutConfig(model=MODEL, gpu="h200", workers=16)
    scenario = rollout_report.Scenario(
        trace="samples:verl3727-qwen3vl-30b-a3b-gspo", config=config, steps=1
    )
    out = rollout_report.run_scenario(scenario).to_json()
    assert out["expert_unavailable_steps"] == out["memory_overflow_steps"] == 0
    assert out["incomplete_responses"] == 0
    assert 0.0 < out["baseline_worker_finish_min_over_max"] <= 1.0


def test_pool_of_one_replica_is_simulate_rollout():
    config = moe.RolloutConfig(model=MODEL, workers=4)
    lengths = [300, 20, 40, 900, 10, 70, 55, 5]
    preds = [float(x) for x in lengths]
    for policy, p in (("baseline", None), ("flexfloor", preds)):
        one = moe.simulate_rollout(config, batch(lengths), policy=policy, predictions=p)
        pool = moe.simulate_pool(config, batch(lengths), replicas=1, policy=policy, predictions=p)
        assert pool == one


def test_pool_baseline_waits_for_the_slowest_replica_flexfloor_frees_finished_ones():
    config = moe.RolloutConfig(model=MODEL, workers=2)
    # Replica 0 gets the long responses (even contiguous chunks), replica 1 short ones.
    lengths = [1500] * 4 + [30] * 4
    preds = [float(x) for x in lengths]
    base = moe.simulate_pool(config, batch(lengths), replicas=2, policy="baseline")
    ff = moe.simulate_pool(
        config, batch(lengths), replicas=2, policy="flexfloor", predictions=preds
    )
    halves = [
        moe.simulate_rollout(config, batch(lengths[:4]), policy="baseline"),
        moe.simulate_rollout(config, batch(lengths[4:]), policy="baseline"),
    ]
    wall = max(h.wall_s for h in halves)
    assert base.wall_s == pytest.approx(wall)
    assert base.occupied_gpu_s == pytest.approx(4 * wall)  # 2 replicas x 2 GPUs, whole wall
    short_wait = 2 * (wall - halves[1].wall_s)
    assert base.idle_after_finish_gpu_s == pytest.approx(
        halves[0].idle_after_finish_gpu_s + halves[1].idle_after_finish_gpu_s + short_wait
    )
    assert all(r == pytest.approx(wall) for r in base.release_s)
    assert ff.occupied_gpu_s < base.occupied_gpu_s
    assert max(ff.release_s[2:]) < wall  # the short replica left before the long one ended
    for r in (base, ff):
        assert r.tokens == sum(lengths) and r.incomplete_responses == 0
        assert r.expert_unavailable_steps == 0 and r.memory_overflow_steps == 0


@settings(max_examples=10, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    replicas=st.integers(1, 4),
    workers=st.integers(1, 4),
)
def test_property_pool_invariants(lengths, replicas, workers):
    config = moe.RolloutConfig(model=MODEL, workers=workers)
    preds = [float(x) for x in reversed(lengths)]
    for policy, p in (("baseline", None), ("flexfloor", preds)):
        r = moe.simulate_pool(
            config, batch(lengths), replicas=replicas, policy=policy, predictions=p
        )
        assert r.incomplete_responses == 0 and r.tokens == sum(lengths)
        assert r.expert_unavailable_steps == 0 and r.memory_overflow_steps == 0
        assert len(r.finish_s) == len(r.release_s) == replicas * workers
        assert 0.0 <= r.idle_after_finish_gpu_s <= r.occupied_gpu_s + 1e-9


def test_pool_refuses_zero_replicas():
    config = moe.RolloutConfig(model=MODEL, workers=2)
    with pytest.raises(moe.errors.InvalidInputError):
        moe.simulate_pool(config, batch([5]), replicas=0, policy="baseline")


def _prompt_means(scenario):
    batches, _ = rollout_report.make_batches(scenario)
    out = []
    for b in batches:
        logs = {}
        for pid, length in zip(b.prompt_ids, b.lengths_tokens, strict=True):
            logs.setdefault(pid, []).append(math.log(length))
        out.append({p: float(np.mean(v)) for p, v in logs.items()})
    return out


@pytest.mark.parametrize("persistence", [0.0, 1.0])
def test_prompt_persistence_across_epochs(persistence):
    # Same prompts every STEPS_PER_EPOCH steps; correlation of their mean log length between
    # epoch 0 and epoch 1 follows the persistence (GRPO groups of 8 average the noise).
    config = moe.RolloutConfig(model=MODEL, workers=4)
    scenario = rollout_report.Scenario(
        trace="samples:verl3727-qwen3vl-30b-a3b-gspo",
        config=config,
        steps=2 * rollout_report.STEPS_PER_EPOCH,
        prompt_persistence=persistence,
        prompt_share=0.9,
    )
    means = _prompt_means(scenario)
    k = rollout_report.STEPS_PER_EPOCH
    pairs = [(means[0][p], means[k][p]) for p in means[0]]
    corr = float(np.corrcoef(np.asarray(pairs).T)[0, 1])
    if persistence == 1.0:
        assert corr > 0.8
    else:
        assert abs(corr) < 0.35


def test_cli_refuses_bad_persistence_and_replicas(capsys):
    assert cli.main(["rollout-sim", "--prompt-persistence", "1.5"]) == 2
    assert cli.main(["rollout-sim", "--replicas", "0"]) == 2
    capsys.readouterr()


def test_cli_replicas_and_exact_lengths_json(capsys):
    code = cli.main(
        [
            "rollout-sim",
            "--trace",
            "verl-ppo-qwen25-7b-gsm8k-16gpu",
            "--workers",
            "2",
            "--replicas",
            "2",
            "--steps",
            "1",
            "--exact-lengths",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["replicas"] == 2 and out["gpus"] == 4 and out["exact_lengths"] is True
    assert 0.0 <= out["baseline_worker_finish_mean_over_max"] <= 1.0
    assert out["expert_unavailable_steps"] == out["memory_overflow_steps"] == 0


# ----- trace forms, named scenarios, kernel step model, tensor parallel ------------------------
def test_cli_trace_takes_a_csv_path_and_a_verl_log(tmp_path, capsys):
    _, src, meta = rollout_report.traces.load_rows("verl-gpg-qwen2-7b-fsdp-8gpu")
    csv_path = tmp_path / "mine.csv"
    (tmp_path / "mine.meta.json").write_text(json.dumps(meta))
    keys = sorted({k for r in src for k in r})
    csv_path.write_text(
        ",".join(keys) + "\n" + "\n".join(",".join(str(r.get(k, "")) for k in keys) for r in src)
    )
    log_path = tmp_path / "mine.log"
    log_path.write_text(
        "\n".join(
            "(TaskRunner pid=1) step:"
            + str(int(r["step"]))
            + " - "
            + " - ".join(f"{k}:{v}" for k, v in r.items() if k != "step")
            for r in src
        )
    )
    for path in (csv_path, log_path):
        argv = ["rollout-sim", "--trace", str(path), "--workers", "2", "--steps", "1"]
        assert cli.main([*argv, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["trace"] == str(path) and out["scenario"] is None
        assert out["incomplete_responses"] == 0
    # The packaged trace gives the same lengths as its CSV copy.
    by_name = rollout_report.trace_step_lengths("verl-gpg-qwen2-7b-fsdp-8gpu")
    assert rollout_report.trace_step_lengths(str(csv_path)) == by_name


@pytest.mark.parametrize(
    "argv",
    [
        ["--trace", "/nonexistent/trace.csv"],
        ["--scenario", "no-such-scenario"],
    ],
)
def test_cli_bad_trace_or_scenario_exits_2(argv, capsys):
    assert cli.main(["rollout-sim", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlenergy: error:") and "\n" not in err


def test_named_scenarios_shapes_and_sources():
    from rlenergy.sim import rollout_scenarios as rs

    assert set(rs.names()) == {"seer-long-cot", "verl3727", "qwen3-30b-a3b-long-cot"}
    seer = rs.scenario("seer-long-cot", steps=1)
    assert seer.replicas * seer.config.workers * seer.config.tensor_parallel == 128
    assert seer.lengths is not None
    assert seer.lengths[0].responses == 600 * rs.SEER_GROUP_SIZE
    q = rs.scenario("qwen3-30b-a3b-long-cot", steps=1)
    assert q.config.step_model == "kernels" and q.replicas * q.config.workers == 16
    for named in rs.SCENARIOS.values():
        assert named.sources


def test_verl3727_scenario_json_has_scenario_key(capsys):
    code = cli.main(["rollout-sim", "--scenario", "verl3727", "--steps", "1", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scenario"] == "verl3727" and out["gpus"] == 16
    assert out["expert_unavailable_steps"] == 0 and out["memory_overflow_steps"] == 0
    assert out["incomplete_responses"] == 0
    # Balancing the engines never makes the rollout slower than the even split here.
    assert out["generation_throughput_ratio"] >= 1.0


def test_seer_lengths_keep_the_published_mean():
    from rlenergy.sim import rollout_scenarios as rs

    batches, limit = rollout_report.make_batches(rs.scenario("seer-long-cot", steps=1))
    lengths = np.asarray(batches[0].lengths_tokens)
    assert limit == 40960 and lengths.max() <= 40960
    assert lengths.mean() == pytest.approx(7615, rel=0.1)  # one draw of 4,800 responses


def test_kernel_step_model_reproduces_the_composed_table():
    from rlenergy.sim import moe_kernels

    m = moe_kernels.KernelTableStepModel(padded=False, resize_s=7.0, kv_bytes_per_token=98304)
    # derived_survivor_step_ratio_qwen3_30b_h200.csv, balanced, ctx 4096 (step_ms_after_shrink).
    for b, ranks, table_ms in ((1, 8, 5.403), (16, 8, 8.431), (64, 8, 15.5), (16, 4, 9.701)):
        ms = m.steps_s(np.full(ranks, b), np.full(ranks, b * 4096.0), np.full(ranks, 16))[0]
        assert ms * 1e3 == pytest.approx(table_ms, rel=0.05)
    # Survivors get slower, not faster, at b = 16 (README section 1c).
    eight = m.steps_s(np.full(8, 16), np.full(8, 16 * 4096.0), np.full(8, 16))[0]
    four = m.steps_s(np.full(4, 16), np.full(4, 16 * 4096.0), np.full(4, 32))[0]
    assert four > eight
    # Padding: a finished rank still pushes the largest batch through the MoE layers.
    mixed = np.asarray([16, 0, 0, 0, 0, 0, 0, 0])
    ctx = mixed * 4096.0
    padded = moe_kernels.KernelTableStepModel(True, 7.0, 98304).steps_s(mixed, ctx, mixed)[0]
    assert padded > m.steps_s(mixed, ctx, mixed)[0]


def test_tensor_parallel_worker_occupies_its_gpus():
    dense = moe.MOE_MODELS["qwen2-vl-72b"]
    one = moe.RolloutConfig(model=dense, gpu="h100-sxm", workers=1, tensor_parallel=8)
    r = moe.simulate_rollout(one, batch([200, 50], prompt=32), policy="baseline")
    assert r.occupied_gpu_s == pytest.approx(8 * r.wall_s)
    with pytest.raises(moe.errors.InvalidInputError):
        moe.RolloutConfig(model=dense, gpu="h100-sxm", workers=1)  # 144 GB on one 80 GB GPU


def test_modes_are_enums_and_an_unknown_one_says_which():
    config = moe.RolloutConfig(model=MODEL, workers=4)
    lengths = [40, 10, 10, 10, 30, 20]
    as_enum = moe.simulate_rollout(
        config, batch(lengths), policy=moe.Policy.FLEXFLOOR, placement_mode=moe.Placement.LENGTH
    )
    as_text = moe.simulate_rollout(
        config, batch(lengths), policy="flexfloor", placement_mode="length"
    )
    assert as_enum == as_text and as_enum.policy == "flexfloor"
    with pytest.raises(moe.errors.InvalidInputError, match="unknown placement 'balanced'"):
        moe.simulate_rollout(config, batch(lengths), policy="flexfloor", placement_mode="balanced")
    with pytest.raises(moe.errors.InvalidInputError, match="unknown policy 'elastic'"):
        moe.simulate_rollout(config, batch(lengths), policy="elastic")
