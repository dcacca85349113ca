"""The loss scalers against torch.amp.GradScaler on fp16 runs that overflow."""
import pytest
import torch

from course_lib.memory.loss_scaling import (DynamicLossScaler, StaticLossScaler, fp16_run,
                                            grad_scaler)

SETTINGS = [dict(init_scale=2.0**16, growth_interval=4),
            dict(init_scale=2.0**3, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)]


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_dynamic_scaler_follows_grad_scaler_step_for_step(settings):
    ours = fp16_run(DynamicLossScaler(**settings), steps=20)
    torch_own = fp16_run(grad_scaler(**settings), steps=20)
    assert ours["scales"] == torch_own["scales"]
    assert ours["stepped"] == torch_own["stepped"]
    assert ours["multiplied"] == torch_own["multiplied"]
    assert all(torch.equal(a, b) for a, b in zip(ours["params"], torch_own["params"]))
    # the run is a test of something: it overflows, backs off, steps and grows
    assert not all(ours["stepped"]) and any(ours["stepped"])
    assert any(b > a for a, b in zip(ours["scales"], ours["scales"][1:]))


def test_a_static_scale_too_large_skips_every_step_and_keeps_the_weights_finite():
    run = fp16_run(StaticLossScaler(2.0**16), steps=6)
    assert not any(run["stepped"]) and set(run["scales"]) == {2.0**16}
    assert all(torch.isfinite(p).all() for p in run["params"])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="growth_factor > 1"):
        DynamicLossScaler(growth_factor=0.5)
