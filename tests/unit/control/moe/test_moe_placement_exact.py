"""Placement in detail: exact placements, the occupancy forecast, the fluid and lockstep models.

We test these aspects:
* ``place_by_length``: longest first in rank order, up to the cap (an even share by default)
  and the KV budget (a response that fills a budget exactly fits); past the last worker the
  emptiest worker that still fits, else queued on the one with the most budget left (ties:
  the lowest rank); ``balance="tokens"`` moves on once a worker holds an even share of tokens;
* ``forecast_occupied_gpu_s`` by hand: segments cut at the predicted ends, the responses still
  running in each with their context, waves on an over-subscribed worker, and (elastic) the
  idle workers that leave with their experts spread round-robin over the kept ones, as many
  kept as the memory after the busy workers' predicted KV needs;
* ``expected_occupied_gpu_s`` averages over log-normal length draws (deterministic);
* the fluid model's KV waves and one-token responses, ``place_balanced``'s order and ties,
  ``place_lockstep``'s boustrophedon deal, ``lockstep_makespan_s`` with prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from moe_support import MODEL

from rlenergy.control.moe import base, placement


def test_response_kv_is_prompt_plus_rounded_up_response_times_bytes_per_token():
    assert placement.response_kv_bytes(10, 4.2, 3) == (10 + 5) * 3


def test_longest_first_in_rank_order_up_to_an_even_share():
    lengths = [10.0, 30.0, 20.0, 40.0, 5.0, 1.0]
    p = placement.place_by_length(lengths, [0] * 6, [1000] * 3, 1)
    # 40, 30 -> worker 0; 20, 10 -> worker 1; 5, 1 -> worker 2 (cap ceil(6 / 3) = 2).
    assert p.worker_of == (1, 0, 1, 0, 2, 2)
    assert p.queued == (False,) * 6
    assert p.predicted_kv_bytes == (70, 30, 6)
    capped = placement.place_by_length(lengths, [0] * 6, [1000] * 3, 1, max_responses_per_worker=3)
    assert capped.worker_of == (1, 0, 0, 0, 1, 1)


def test_a_response_that_fills_a_budget_exactly_fits():
    # Worker 0 holds 50 + 40 = 90 of its 90 bytes.
    full = placement.place_by_length([50.0, 40.0], [0, 0], [90, 100], 1, max_responses_per_worker=2)
    assert (full.worker_of, full.predicted_kv_bytes) == ((0, 0), (90, 0))
    one = placement.place_by_length([100.0], [0], [100], 1)
    assert (one.worker_of, one.queued, one.predicted_kv_bytes) == ((0,), (False,), (100,))


def test_past_the_last_worker_the_emptiest_that_still_fits():
    # 50 -> 0; 40 does not fit 0 (90 > 60) -> 1; 30 -> 1 (70 of 100); the last 30 finds
    # worker 1 at its cap, past the last worker: worker 1 still fits it exactly (100).
    p = placement.place_by_length([50.0, 40.0, 30.0, 30.0], [0] * 4, [60, 100], 1)
    assert p.worker_of == (0, 1, 1, 1)
    assert p.queued == (False,) * 4
    assert p.predicted_kv_bytes == (50, 100)


def test_a_response_no_worker_can_take_now_is_queued_where_most_budget_is_left():
    # 120 fits only worker 1 (150); the next two fit nowhere now: queued on worker 0, which
    # has all its 100 bytes left (worker 1: 30); queued responses take no budget.
    p = placement.place_by_length([120.0, 120.0, 90.0], [0] * 3, [100, 150], 1)
    assert p.worker_of == (1, 0, 0)
    assert p.queued == (False, True, False)
    assert p.predicted_kv_bytes == (90, 120)
    # Equal budgets left: the lowest rank waits.
    tie = placement.place_by_length([80.0, 80.0, 80.0], [0] * 3, [100, 100], 1)
    assert tie.worker_of == (0, 1, 0)
    assert tie.queued == (False, False, True)


def test_token_balance_moves_on_at_an_even_share_of_tokens():
    # Share 100 tokens per worker. 80 -> 0; 60 would take worker 0 past its share by more
    # than half of itself (80 + 30 > 100) -> 1; 40 -> 1 (60 + 20 <= 100); 20: worker 1 is at
    # its cap (2), past the last worker -> the emptiest, worker 0.
    p = placement.place_by_length(
        [80.0, 60.0, 40.0, 20.0], [0] * 4, [10**6] * 2, 1, balance="tokens"
    )
    assert p.worker_of == (0, 1, 1, 0)
    counted = placement.place_by_length([80.0, 60.0, 40.0, 20.0], [0] * 4, [10**6] * 2, 1)
    assert counted.worker_of == (0, 0, 1, 1)
    # Three workers, share 70, no cap: 60 | 50, 40 | 30, 20, 10.
    three = placement.place_by_length(
        [60.0, 50.0, 40.0, 30.0, 20.0, 10.0],
        [0] * 6,
        [10**6] * 3,
        1,
        balance="tokens",
        max_responses_per_worker=10,
    )
    assert three.worker_of == (0, 1, 1, 2, 2, 2)


class Batch:
    """Step time = 1 s per expert on the busiest worker + 1 s per running response + 1 s per
    10 B of KV in the group; records the group it is asked about."""

    def __init__(self) -> None:
        self.seen: list[list[base.WorkerState]] = []

    def decode_step_s(self, workers: Sequence[base.WorkerState]) -> float:
        self.seen.append(list(workers))
        return (
            max(len(w.experts) for w in workers)
            + sum(w.running for w in workers)
            + sum(w.kv_bytes for w in workers) / 10
        )

    def copy_s(self, moves: Sequence[base.ExpertMove]) -> float:
        return 0.0


class RunningKv:
    """Step time = 1 s per running response + 1 s per 100 B of KV in the group."""

    def decode_step_s(self, workers: Sequence[base.WorkerState]) -> float:
        return sum(w.running for w in workers) + sum(w.kv_bytes for w in workers) / 100

    def copy_s(self, moves: Sequence[base.ExpertMove]) -> float:
        return 0.0


def test_forecast_runs_an_over_subscribed_worker_in_waves():
    # KV budget per worker: 950 - 50 dense - 100 (one expert) = 800 B; 2 B per token.
    # Worker 0: two responses of prompt 100, length 300: peak (400 x 2) x 2 B = 1600 B = 2x
    # its budget: 2 waves, spans 600, one response at a time. Worker 1: prompt 50, length 100.
    lay = base.MoeLayout(2, 100, 50, 2, 950)
    args = ([0, 0, 1], [300.0, 300.0, 100.0], [100, 100, 50], [frozenset({0}), frozenset({1})])
    # [0, 100): worker 0 runs 1 response with 100 tokens (200 B), worker 1 one with 50 (100 B):
    # 2 + 3 = 5 s per step. [100, 600): worker 0 one response with 100 + 100 / 2 tokens (300 B):
    # 1 + 3 = 4 s. The group stays 2 workers (elastic: worker 0's memory is full, worker 1's
    # expert has nowhere to go).
    expected = 100 * 2 * 5 + 500 * 2 * 4
    for elastic in (False, True):
        got = placement.forecast_occupied_gpu_s(*args, lay, RunningKv(), elastic=elastic)
        assert got == pytest.approx(expected)


def test_forecast_cuts_at_every_end_thinned_to_16():
    # 17 responses of 1 .. 17 steps on one worker (no KV): 17 ends thinned to the order
    # statistics round(i x 16 / 15): the cut at 9 goes, [8, 10) runs 9 responses.
    lay = base.MoeLayout(1, 1, 0, 0, 10)
    lengths = [float(t) for t in range(1, 18)]
    got = placement.forecast_occupied_gpu_s(
        [0] * 17, lengths, [0] * 17, [frozenset({0})], lay, RunningKv(), elastic=False
    )
    assert got == pytest.approx(108 + 2 * 9 + 28)


def test_forecast_of_one_response_on_a_group_with_an_idle_worker():
    # One response of 10 steps (prompt 0) on worker 0: context 0 over [0, 10), the one
    # segment; kept for the whole rollout, worker 1 idles along.
    lay = base.MoeLayout(2, 10, 0, 1, 1000)
    shards = [frozenset({0}), frozenset({1})]
    fixed = placement.forecast_occupied_gpu_s(
        [0], [10.0], [0], shards, lay, RunningKv(), elastic=False
    )
    assert fixed == pytest.approx(10 * 2 * 1)
    # Elastic: worker 1 leaves at once, its expert fits worker 0 (990 - 10 B free).
    elastic = placement.forecast_occupied_gpu_s(
        [0], [10.0], [0], shards, lay, RunningKv(), elastic=True
    )
    assert elastic == pytest.approx(10 * 1 * 1)


def test_forecast_idle_workers_leave_when_the_busy_ones_hold_their_experts_exactly():
    # 3 workers, 2 experts of 10 B each, 120 B: 100 B of KV budget. Worker 0 runs a response
    # of 60 steps (peak 60 B: 40 B left = the 4 experts of workers 1 and 2), they run 10.
    lay = base.MoeLayout(6, 10, 0, 1, 120)
    shards = [frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 5})]
    cost = Batch()
    got = placement.forecast_occupied_gpu_s(
        [0, 1, 2], [60.0, 10.0, 10.0], [0, 0, 0], shards, lay, cost, elastic=True
    )
    # [0, 10): 3 workers, 2 experts each, 3 running, no KV: 5 s. [10, 60): worker 0 alone
    # with all 6 experts, 1 running, 10 tokens of context (10 B): 6 + 1 + 1 = 8 s.
    assert got == pytest.approx(10 * 3 * 5 + 50 * 1 * 8)
    assert [sorted(cost.seen[-1][0].experts)] == [[0, 1, 2, 3, 4, 5]]


def test_forecast_keeps_the_fewest_idle_workers_whose_room_holds_the_rest():
    # Worker 0 runs 80 steps (100 B budget, 80 B peak: 20 B left, 2 experts); workers 1-3
    # run 10. Worker 1 (1 expert, 110 B budget) must stay for workers 2 and 3 to leave; their
    # 5 experts go round-robin to workers 0 and 1.
    lay = base.MoeLayout(8, 10, 0, 1, 120)
    shards = [frozenset({0, 1}), frozenset({2}), frozenset({3, 4, 5}), frozenset({6, 7})]
    cost = Batch()
    got = placement.forecast_occupied_gpu_s(
        [0, 1, 2, 3], [80.0, 10.0, 10.0, 10.0], [0] * 4, shards, lay, cost, elastic=True
    )
    # [0, 10): 4 workers, busiest 3 experts, 4 running: 7 s. [10, 80): workers 0 and 1,
    # {0, 1, 3, 5, 7} and {2, 4, 6}: 5 experts + 1 running + 10 B: 7 s.
    assert got == pytest.approx(10 * 4 * 7 + 70 * 2 * 7)
    assert cost.seen[0] == [base.WorkerState(w, shards[w], 1, 0, running=1) for w in range(4)]
    assert cost.seen[1] == [
        base.WorkerState(0, frozenset({0, 1, 3, 5, 7}), 1, 10, running=1),
        base.WorkerState(1, frozenset({2, 4, 6}), 0, 0, running=0),
    ]


def test_expected_forecast_averages_log_normal_draws():
    # One response, one worker, 1 s per running response, no KV: the forecast is the drawn
    # length itself, so the average of 400 draws of 100 x exp(0.5 z) is near its mean
    # 100 x exp(0.125) = 113.3 (standard error about 3).
    lay = base.MoeLayout(1, 1, 0, 0, 10)
    args = ([0], [100.0], [0.5], [0], [frozenset({0})], lay, RunningKv())
    got = placement.expected_occupied_gpu_s(*args, elastic=False, draws=400)
    assert 100 * math.exp(0.125) - 12 < got < 100 * math.exp(0.125) + 12
    # Common random numbers: the same seed (0 by default) gives the same draws.
    assert placement.expected_occupied_gpu_s(*args, elastic=False) == (
        placement.expected_occupied_gpu_s(*args, elastic=False, seed=0)
    )
    # A length drawn (or predicted) below one token counts one token: 1.5 stays 1.5.
    exact = ([0], [1.5], [0.0], [0], [frozenset({0})], lay, RunningKv())
    assert placement.expected_occupied_gpu_s(*exact, elastic=False) == pytest.approx(1.5)


def test_fluid_model_kv_waves_and_one_token_responses():
    small = placement.FluidFinishModel(0.01, 1e-12, 1e6, 1000, 64)
    load = placement.EngineLoad()
    for _ in range(10):
        load = small.add(load, 0, 1000)
    # KV byte-steps 10 x 500 x 1000 x 1000 = 5e9 over 1e6 B: 5000 steps > 1000 (longest) >
    # 10000 / 64 (running cap).
    assert small.finish_s(load) == pytest.approx(5000 * 0.01 + 5e9 * 1e-12)
    one = MODEL.add(placement.EngineLoad(), 0, 1)
    assert one == placement.EngineLoad(tokens=1.0, longest_tokens=1.0, kv_byte_steps=500.0)
    assert MODEL.finish_s(one) == pytest.approx(0.01 + 500 * 1e-12)
    assert MODEL.add(placement.EngineLoad(), 0, 0.5) == one  # at least one token


def test_balanced_placement_order_and_ties():
    # 30 -> engine 0 (a tie between empty engines: the lowest); 20 -> engine 1; 10 -> engine 1
    # (finishes with 20 + 10 before engine 0 with 30 + 10).
    assert placement.place_balanced([10.0, 30.0, 20.0], [0] * 3, 2, MODEL) == (1, 0, 1)
    assert placement.predicted_makespan_s([], [], [], 0, MODEL) == 0.0


def test_lockstep_deals_there_and_back():
    # Longest first: 7 6 5 | 4 3 2 | 1 to ranks 0 1 2 | 2 1 0 | 0.
    dealt = placement.place_lockstep([1.0, 7.0, 3.0, 6.0, 2.0, 5.0, 4.0], 3)
    assert dealt == (0, 0, 1, 1, 0, 2, 2)


def test_lockstep_makespan_with_prompts():
    # Rank 0: prompts 100 and 50, lengths 10 and 20; rank 1: prompt 0, length 30. KV peak
    # (tokens): [0, 10) 150 + 2t, [10, 20) 50 + t, [20, 30) t (rank 1 leads): trapezoids
    # 160, 65, 25 thousand bytes over 10 steps each.
    got = placement.lockstep_makespan_s(
        [0, 0, 1],
        [10.0, 20.0, 30.0],
        [100, 50, 0],
        2,
        placement.FluidFinishModel(0.01, 1e-9, 1e12, 1000, 1024),
    )
    assert got == pytest.approx(
        10 * (0.01 + 160e3 * 1e-9) + 10 * (0.01 + 65e3 * 1e-9) + 10 * (0.01 + 25e3 * 1e-9)
    )
    # A response predicted under one token runs one step: KV 0 -> 1000 B.
    short = placement.lockstep_makespan_s(
        [0], [0.5], [0], 1, placement.FluidFinishModel(0.01, 1e-9, 1e12, 1000, 1024)
    )
    assert short == pytest.approx(0.01 + 500 * 1e-9)


def test_forecast_a_one_token_response_runs_one_step():
    lay = base.MoeLayout(1, 1, 0, 0, 10)
    got = placement.forecast_occupied_gpu_s(
        [0], [1.0], [0], [frozenset({0})], lay, RunningKv(), elastic=False
    )
    assert got == pytest.approx(1.0)


def test_forecast_an_idle_worker_stays_when_the_busy_ones_lack_room_for_its_experts():
    # 130 B per worker, 10 B dense, 10 B per expert: worker 0 (2 experts) has 100 B of KV
    # budget, its response's peak 80 B leaves 20 B, short of worker 1's 3 experts (30 B).
    lay = base.MoeLayout(5, 10, 10, 1, 130)
    shards = [frozenset({0, 1}), frozenset({2, 3, 4})]
    got = placement.forecast_occupied_gpu_s(
        [0, 1], [80.0, 10.0], [0, 0], shards, lay, RunningKv(), elastic=True
    )
    # [0, 10): 2 running; [10, 80): both workers stay, 1 running with 10 B of context.
    assert got == pytest.approx(10 * 2 * 2 + 70 * 2 * 1.1)


def test_forecast_thinning_keeps_the_last_order_statistic():
    # 16 responses of 1 .. 16 steps and one of 20: the thinned cuts are 1 .. 8, 10 .. 16 and
    # 20. Running: 17 .. 10 over [0, 8), 9 over [8, 10), 7 .. 2 over [10, 16), 1 over [16, 20).
    lay = base.MoeLayout(1, 1, 0, 0, 10)
    lengths = [float(t) for t in range(1, 17)] + [20.0]
    got = placement.forecast_occupied_gpu_s(
        [0] * 17, lengths, [0] * 17, [frozenset({0})], lay, RunningKv(), elastic=False
    )
    assert got == pytest.approx(108 + 2 * 9 + 27 + 4 * 1)


def test_forecast_a_waved_worker_makes_room_as_its_responses_end():
    # KV budget 200 B per worker (210 B, one 10 B expert each, 1 B per token). Worker 0: two
    # responses of 300 and 100 tokens, 400 B: two waves, spans 600 and 200, one running at a
    # time. Worker 1: one response of 50 steps.
    lay = base.MoeLayout(2, 10, 0, 1, 210)
    shards = [frozenset({0}), frozenset({1})]
    got = placement.forecast_occupied_gpu_s(
        [0, 0, 1], [300.0, 100.0, 50.0], [0, 0, 0], shards, lay, RunningKv(), elastic=True
    )
    # [0, 50): 1 + 1 running, no context. [50, 200): worker 0 runs 1 (context (25 + 25) / 2),
    # its peak (300 + 100) / 2 fills its budget: worker 1 stays. [200, 600): the 300-token
    # response alone (context 200 / 2 / 2 = 50 B), peak 150 B: 50 B free holds expert 1,
    # worker 1 leaves.
    assert got == pytest.approx(50 * 2 * 2 + 150 * 2 * 1.25 + 400 * 1 * 1.5)
