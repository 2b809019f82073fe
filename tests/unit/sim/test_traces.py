"""verl step-log parsing: CSV traces, console logs, metric name variants, honest gaps."""

import pytest

from rlenergy import errors
from rlenergy.gpu import models
from rlenergy.sim import traces, workload

STEP_TRACES = traces.packaged_trace_names()


def test_seven_step_traces_are_shipped_and_snapshot_tables_are_not_replayable() -> None:
    assert len(STEP_TRACES) == 7
    assert "samples" not in STEP_TRACES
    with pytest.raises(errors.InvalidInputError, match="snapshots"):
        traces.load_trace("verl-megatron-practice-phase-tables")


@pytest.mark.parametrize("name", STEP_TRACES)
def test_every_shipped_trace_yields_phase_work(name: str) -> None:
    t = traces.load_trace(name)
    assert t.steps
    for s in t.steps:
        assert s.gen_time_s > 0 and s.train_time_s > 0
        assert s.valid_tokens > 0 and s.response_tokens >= s.valid_tokens
    assert any("generation time from" in n for n in t.notes)


def test_old_and_new_verl_metric_names_both_map() -> None:
    old = traces.load_trace("verl-ppo-qwen25-05b-gsm8k-resp256-1gpu")
    new = traces.load_trace("verl-ppo-qwen25-7b-gsm8k-16gpu")
    assert "generation time from timing/gen" in old.notes
    assert "generation time from timing_s/gen" in new.notes
    # The old log has no step time: said, not guessed.
    assert any("no step time" in n for n in old.notes)


def test_a_log_without_timing_gen_uses_the_rollout_timer_and_says_so() -> None:
    t = traces.load_trace("verl-grpo-uitars15-7b-gui-agent-8gpu")
    assert "generation time from timing_s/get_batch_rollout_with_filtering" in t.notes


LOG = """\
(main_task pid=1) some banner line
(main_task pid=1) step:1 - timing_s/gen:10.0 - timing_s/old_log_prob:2.0 - timing_s/update_actor:5.0 - response_length/mean:100.0 - response_length/max:400.0 - prompt_length/mean:50.0 - timing_s/step:18.0
(main_task pid=1) step:2 - timing/gen:11.0 - timing/update_actor:5.5 - response_length/mean:120.0 - prompt_length/mean:50.0
"""


def test_console_log_parses_and_maps_both_namings(tmp_path) -> None:
    path = tmp_path / "run.log"
    path.write_text(LOG)
    (tmp_path / "run.meta.json").write_text(
        '{"train_batch_size": 8, "rollout_n": 2, "gpu": {"type": "H100", "count": 4}}'
    )
    t = traces.load_trace(str(path))
    assert [s.step for s in t.steps] == [1, 2]
    assert t.steps[0].gen_time_s == 10.0 and t.steps[0].train_time_s == 7.0
    assert t.steps[0].other_time_s == pytest.approx(1.0)
    assert t.steps[1].samples == 16 and t.num_gpus == 4


def test_malformed_console_line_names_the_line(tmp_path) -> None:
    path = tmp_path / "bad.log"
    path.write_text("step:3 - timing_s/gen:abc - response_length/mean:3\n")
    with pytest.raises(errors.InvalidInputError, match=r"bad:1.*timing_s/gen"):
        traces.load_trace(str(path))


def test_unknown_trace_lists_the_shipped_ones() -> None:
    with pytest.raises(errors.InvalidInputError, match="verl-gpg-qwen2-7b-fsdp-8gpu"):
        traces.load_trace("no-such-trace")


def test_short_trace_replays_cyclically_and_says_so() -> None:
    sku = models.get_sku("h100-sxm")
    rep = workload.from_trace(
        traces.load_trace("tinyzero-ppo-qwen25-05b-countdown-rtx4090"), sku, 50
    )
    assert len(rep.steps) == 50
    assert rep.steps[17].cycle == 1 and rep.steps[17].source_step == rep.steps[0].source_step
    assert any("replayed cyclically" in n for n in rep.notes)
    assert any("rescaled from rtx4090" in n for n in rep.notes)


def test_rescaling_follows_bandwidth_and_flops() -> None:
    t = traces.load_trace("verl-grpo-deepseek7b-mi300-8gpu")
    h100 = workload.from_trace(t, models.get_sku("h100-sxm"), 5)
    b200 = workload.from_trace(t, models.get_sku("b200"), 5)
    # B200 has more bandwidth and compute: every phase is faster at max boost.
    for a, b in zip(h100.steps, b200.steps, strict=True):
        assert b.phase("generation").boost_time_s < a.phase("generation").boost_time_s
        assert b.phase("training").boost_time_s < a.phase("training").boost_time_s
