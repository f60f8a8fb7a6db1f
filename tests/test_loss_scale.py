import dataclasses
import math

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import kmp
from kmp.backend import finite as finite_lib
from kmp.scaling import config as ls_config
from kmp.scaling import state as ls_state


def reference_step(config, state, grads_finite):
    """The docstring pseudocode of `next_state`, in plain Python, with the
    scale in float32 as the state holds it (growth by 1.5 rounds)."""
    f32 = np.float32
    s = dict(state)
    if grads_finite:
        s["consecutive_skips"] = 0
        s["hysteresis_left"] = config.hysteresis
        s["good_steps"] = min(s["good_steps"] + 1, ls_state.COUNTER_MAX)
        if config.mode == "dynamic" and s["good_steps"] >= config.dynamic_growth_steps:
            grown = f32(s["scale"]) * f32(config.growth_factor)
            s["scale"] = float(min(grown, f32(config.max_scale)))
            s["good_steps"] = 0
    else:
        s["skipped_total"] = min(s["skipped_total"] + 1, ls_state.COUNTER_MAX)
        s["consecutive_skips"] = min(s["consecutive_skips"] + 1, ls_state.COUNTER_MAX)
        s["good_steps"] = 0
        if config.mode == "dynamic":
            if s["hysteresis_left"] <= 1:
                backed = f32(s["scale"]) * f32(config.backoff_factor)
                s["scale"] = float(max(backed, f32(config.min_scale)))
            else:
                s["hysteresis_left"] -= 1
    s["last_finite"] = grads_finite
    return s


def as_python(state):
    return {
        f.name: getattr(state, f.name).numpy().item() for f in dataclasses.fields(state)
    }


powers_of_two = st.integers(-4, 30).map(lambda e: 2.0**e)
configs = st.builds(
    lambda initial, lo, hi, growth, backoff, interval, hysteresis, mode: (
        ls_config.LossScaleConfig(
            initial_scale=min(max(initial, lo), max(lo, hi)),
            min_scale=lo,
            max_scale=max(lo, hi),
            growth_factor=growth,
            backoff_factor=backoff,
            dynamic_growth_steps=interval,
            hysteresis=hysteresis,
            mode=mode,
        )
    ),
    powers_of_two,
    st.integers(-4, 4).map(lambda e: 2.0**e),
    st.integers(4, 30).map(lambda e: 2.0**e),
    st.sampled_from([2.0, 4.0, 1.5]),
    st.sampled_from([0.5, 0.25, 0.75]),
    st.integers(1, 5),
    st.integers(1, 4),
    st.sampled_from(ls_config.MODES),
)


@settings(max_examples=60, deadline=None)
@given(config=configs, steps=st.lists(st.booleans(), min_size=1, max_size=40))
def test_next_state_matches_the_docstring_pseudocode(config, steps):
    state = ls_state.LossScaleState.initial(config)
    expected = as_python(state)
    for finite in steps:
        state = ls_state.next_state(config, state, finite)
        expected = reference_step(config, expected, finite)
        assert as_python(state) == expected  # exact: float32 on both sides
        assert config.min_scale <= expected["scale"] <= config.max_scale or (
            config.mode == "none"
        )


def test_ten_thousand_overflows_keep_the_scale_at_the_floor():
    config = ls_config.LossScaleConfig(min_scale=1.0)
    state = ls_state.LossScaleState.initial(config)
    step = tf.function(
        lambda fields: ls_state.next_state(
            config, ls_state.LossScaleState(*fields), False
        ).fields()
    )
    fields = state.fields()
    for _ in range(10_000):
        fields = step(fields)
    state = ls_state.LossScaleState(*fields)
    assert state.scale.numpy() == 1.0
    assert state.skipped_total.numpy() == 10_000
    assert state.consecutive_skips.numpy() == 10_000
    # The next finite step is usable: the scale is still a positive number.
    state = ls_state.next_state(config, state, True)
    assert state.scale.numpy() == 1.0 and state.consecutive_skips.numpy() == 0


def test_growth_stops_at_the_ceiling():
    config = ls_config.LossScaleConfig(initial_scale=2.0**23, dynamic_growth_steps=1)
    state = ls_state.LossScaleState.initial(config)
    for _ in range(5):
        state = ls_state.next_state(config, state, True)
    assert state.scale.numpy() == 2.0**24


def test_hysteresis_tolerates_n_minus_one_overflows_then_backs_off_each_time():
    config = ls_config.LossScaleConfig(initial_scale=1024.0, hysteresis=3)
    state = ls_state.LossScaleState.initial(config)
    scales = []
    for finite in [False, False, False, False, True, False]:
        state = ls_state.next_state(config, state, finite)
        scales.append(state.scale.numpy().item())
    assert scales == [1024.0, 1024.0, 512.0, 256.0, 256.0, 256.0]


def test_counters_saturate_instead_of_wrapping():
    config = ls_config.LossScaleConfig()
    big = tf.constant(ls_state.COUNTER_MAX, tf.int64)
    state = dataclasses.replace(
        ls_state.LossScaleState.initial(config),
        skipped_total=big,
        consecutive_skips=big,
    )
    state = ls_state.next_state(config, state, False)
    assert state.skipped_total.numpy() == ls_state.COUNTER_MAX
    assert state.consecutive_skips.numpy() == ls_state.COUNTER_MAX


def test_static_mode_keeps_the_scale_and_still_counts_skips():
    config = ls_config.LossScaleConfig(
        initial_scale=128.0, mode="static", dynamic_growth_steps=1
    )
    state = ls_state.LossScaleState.initial(config)
    for finite in [True, True, False, True]:
        state = ls_state.next_state(config, state, finite)
    assert state.scale.numpy() == 128.0
    assert state.skipped_total.numpy() == 1


def test_a_scale_change_through_variables_does_not_retrace():
    config = ls_config.LossScaleConfig(initial_scale=8.0, dynamic_growth_steps=1)
    init = ls_state.LossScaleState.initial(config)
    variables = ls_state.LossScaleState(*(tf.Variable(v) for v in init.fields()))
    traces = []

    @tf.function
    def step(finite):
        traces.append(1)
        new = ls_state.next_state(config, variables, finite)
        for var, value in zip(variables.fields(), new.fields(), strict=True):
            var.assign(value)

    for finite in [True, False, False, True, True]:
        step(tf.constant(finite))
    assert len(traces) == 1
    # 8 -> 16 (grow) -> 8 -> 4 (back off twice) -> 8 -> 16 (grow twice)
    assert variables.scale.numpy() == 16.0
    assert variables.skipped_total.numpy() == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"initial_scale": 0.0}, "positive finite"),
        ({"initial_scale": -1.0}, "positive finite"),
        ({"initial_scale": math.inf}, "positive finite"),
        ({"initial_scale": math.nan}, "positive finite"),
        ({"initial_scale": "big"}, "positive finite"),
        ({"growth_factor": 1.0}, "greater than 1"),
        ({"growth_factor": 0.5}, "greater than 1"),
        ({"backoff_factor": 1.0}, r"in \(0, 1\)"),
        ({"backoff_factor": 0.0}, "positive finite"),
        ({"min_scale": 4.0, "max_scale": 2.0, "initial_scale": 2.0}, "min_scale"),
        ({"initial_scale": 2.0**30}, "outside"),
        ({"dynamic_growth_steps": 0}, "integer >= 1"),
        ({"hysteresis": 1.5}, "integer >= 1"),
        ({"mode": "auto"}, "Unknown loss-scale mode"),
        ({"max_scale": 3e38}, "too large"),
    ],
)
def test_invalid_configs_are_rejected(kwargs, message):
    with pytest.raises(kmp.LossScaleError, match=message):
        ls_config.LossScaleConfig(**kwargs)


def test_config_round_trips():
    config = ls_config.LossScaleConfig(initial_scale=64.0, hysteresis=2, mode="static")
    assert ls_config.LossScaleConfig.from_config(config.get_config()) == config


def test_all_finite_handles_none_indexed_slices_and_nan():
    sparse = tf.IndexedSlices(tf.constant([[1.0, np.nan]]), tf.constant([0]))
    assert bool(kmp.all_finite([None, tf.ones(2)]))
    assert not bool(kmp.all_finite([tf.ones(2), sparse]))
    assert bool(kmp.all_finite([]))
    flags = finite_lib.finite_flags([tf.ones(1), None, tf.constant([np.inf])])
    assert flags.numpy().tolist() == [True, True, False]  # None counts as finite


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_one_bad_value_anywhere_makes_a_tensor_non_finite(dtype, bad):
    values = np.linspace(-3.0, 3.0, 1000)
    values[617] = bad
    flags = finite_lib.finite_flags([tf.constant(values, dtype), tf.ones(3, dtype)])
    assert flags.numpy().tolist() == [False, True]
    # inf and -inf together (their sum is NaN) are caught too.
    both = np.array([np.inf, 1.0, -np.inf])
    assert not bool(finite_lib.finite_flags([tf.constant(both, dtype)])[0])


def test_16_bit_values_whose_sum_overflows_are_still_finite():
    # Each value is finite in float16, their float16 sum is not (65504 max):
    # 16-bit tensors are checked value by value, not through their sum.
    large = tf.constant([60000.0] * 4, "float16")
    assert bool(finite_lib.finite_flags([large])[0])
    # float32 is checked through its sum: finite values near float32's
    # largest whose sum overflows count as non-finite (as documented).
    huge = tf.constant([3e38, 3e38], "float32")
    assert not bool(finite_lib.finite_flags([huge])[0])
