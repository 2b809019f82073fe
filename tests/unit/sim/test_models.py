"""GPU SKU models: clock tables, default governor, phase curves (calibration/README.md)."""

import hypothesis
import pytest
from hypothesis import strategies as st

from rlenergy.gpu import models


@pytest.mark.parametrize("name", ["h100-sxm", "h200", "b200"])
def test_supported_clocks_are_15_mhz_steps_descending(name: str) -> None:
    sku = models.get_sku(name)
    clocks = sku.supported_sm_clocks_mhz()
    assert clocks[0] == sku.max_sm_clock_mhz
    assert all(a - b == 15 for a, b in zip(clocks, clocks[1:], strict=False))
    assert clocks[-1] >= sku.min_sm_clock_mhz


def test_h100_matches_the_calibration_table() -> None:
    """calibration/README.md: decode and training throughput/power ratios at 1500 and 990 MHz."""
    sku = models.get_sku("h100-sxm")
    ctx = sku.generation.ctx_ref_tokens  # m = m0 = 0.90 at the reference context
    for clock, dec_thr, dec_pow, tr_thr, tr_pow in [
        (1500, 0.969, 0.787, 0.786, 0.665),
        (990, 0.909, 0.625, 0.541, 0.411),
    ]:
        assert 1 / sku.time_factor("generation", clock, ctx) == pytest.approx(dec_thr, abs=0.002)
        assert sku.power_w("generation", clock) / sku.power_w("generation", 1980) == pytest.approx(
            dec_pow, abs=0.002
        )
        assert 1 / sku.time_factor("training", clock, ctx) == pytest.approx(tr_thr, abs=0.002)
        assert sku.power_w("training", clock) / sku.power_w("training", 1980) == pytest.approx(
            tr_pow, abs=0.002
        )


def test_default_governor_is_max_boost_unless_the_power_limit_binds() -> None:
    h100 = models.get_sku("h100-sxm")
    assert h100.effective_clock_mhz("generation", None) == 1980
    b200 = models.get_sku("b200")
    capped = b200.effective_clock_mhz("training", None)
    assert capped < b200.max_sm_clock_mhz
    assert b200.power_w("training", capped) == pytest.approx(b200.power_limit_w)
    # A lock above the capped clock is accepted but the GPU runs at the cap.
    assert b200.effective_clock_mhz("training", 1965) == pytest.approx(capped)
    assert b200.effective_clock_mhz("training", 1500) == 1500


def test_longer_context_makes_decode_more_memory_bound() -> None:
    sku = models.get_sku("h100-sxm")
    assert sku.memory_share("generation", 8192) > sku.memory_share("generation", 256)


def test_unknown_sku_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match="h100-sxm"):
        models.get_sku("a100")


def test_every_sku_parameter_line_has_a_source_or_model_label() -> None:
    from importlib import resources

    text = resources.files("rlenergy.gpu").joinpath("data/gpus.yaml").read_text()
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.endswith(":"):
            continue
        value = stripped.split(":", 1)[1].split("#")[0].strip() if ":" in stripped else ""
        if value and not value.startswith('"') and any(ch.isdigit() for ch in value):
            assert "#" in stripped, f"constant without a source or [MODEL] label: {stripped}"


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    sku=st.sampled_from(["h100-sxm", "h200", "b200"]),
    kind=st.sampled_from(["generation", "training"]),
    threshold=st.floats(0.5, 0.99),
    ctx=st.floats(64, 32768),
)
def test_the_model_estimate_keeps_the_threshold_and_relaxing_it_never_costs_energy(
    sku, kind, threshold, ctx
):
    gpu = models.get_sku(sku)
    clocks = gpu.supported_sm_clocks_mhz()
    est = models.estimate_best_clock(gpu, kind, threshold, ctx, clocks)
    assert est is not None  # the top clock below the default keeps any threshold <= 0.99
    assert est.throughput_ratio >= threshold and est.energy_ratio < 1.0
    assert est.clock_mhz in clocks
    looser = models.estimate_best_clock(gpu, kind, threshold - 0.1, ctx, clocks)
    assert looser is not None and looser.energy_ratio <= est.energy_ratio
    assert looser.clock_mhz <= est.clock_mhz


def test_the_model_estimate_refuses_what_no_clock_can_keep():
    gpu = models.get_sku("h100-sxm")
    assert (
        models.estimate_best_clock(gpu, "training", 1.0, 1024, gpu.supported_sm_clocks_mhz())
        is None
    )
    assert models.estimate_best_clock(gpu, "idle", 0.9, 1024, gpu.supported_sm_clocks_mhz()) is None
    assert models.sku_for_nvml_name(" nvidia h100 80gb hbm3 ") is gpu
    assert models.sku_for_nvml_name("NVIDIA A100-SXM4-80GB") is None
