import keras
import numpy as np
import pytest

import kmp
from kmp.backend import machine
from kmp.precision import auto
from kmp.precision import policy as policy_lib

BUILTIN = {
    "float32": ("float32", "float32", False),
    "mixed_float16": ("float16", "float32", True),
    "mixed_bfloat16": ("bfloat16", "float32", False),
    "float16": ("float16", "float16", True),
    "bfloat16": ("bfloat16", "bfloat16", False),
}


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_policies_have_the_documented_dtypes(name):
    policy = policy_lib.get(name)
    compute, variable, scaling = BUILTIN[name]
    assert (policy.name, policy.compute_dtype, policy.variable_dtype) == (
        name,
        compute,
        variable,
    )
    assert policy.needs_loss_scaling is scaling


def test_policy_is_an_immutable_hashable_value():
    a = kmp.Policy("x", "bfloat16", "float32")
    b = kmp.Policy("x", "bfloat16", "float32")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != kmp.Policy("x", "float16", "float32")
    with pytest.raises(AttributeError):
        a.compute_dtype = "float32"
    assert repr(a) == '<Policy "x": compute=bfloat16, variables=float32>'


def test_policy_round_trips_through_config():
    policy = kmp.Policy("mine", "float16", "float32")
    config = policy.get_config()
    assert config == {
        "name": "mine",
        "compute_dtype": "float16",
        "variable_dtype": "float32",
    }
    assert kmp.Policy.from_config(config) == policy


def test_policy_accepts_numpy_dtypes_and_canonicalises_them():
    policy = kmp.Policy("np", np.float16, np.dtype("float32"))
    assert (policy.compute_dtype, policy.variable_dtype) == ("float16", "float32")


@pytest.mark.parametrize(
    "compute, variable, message",
    [
        ("int8", "float32", "not a floating-point dtype"),
        ("float32", "int32", "not a floating-point dtype"),
        ("float32", "float16", "narrower"),
        ("bfloat16", "float16", "different 16-bit formats"),
        ("float16", "float64", "cannot be expressed"),
        ("nonsense", "float32", "not a dtype"),
    ],
)
def test_invalid_policies_are_rejected_with_the_reason(compute, variable, message):
    with pytest.raises(kmp.PolicyError, match=message):
        kmp.Policy("bad", compute, variable)


def test_unknown_policy_name_lists_the_valid_names():
    with pytest.raises(kmp.PolicyError) as info:
        kmp.set_policy("mixed_float8")
    text = str(info.value)
    assert "'mixed_float8'" in text
    for name in BUILTIN:
        assert repr(name) in text


def test_set_policy_rejects_non_policy_objects():
    with pytest.raises(TypeError, match="Received: 3"):
        kmp.set_policy(3)


def test_set_policy_writes_through_to_keras():
    kmp.set_policy("mixed_float16")
    assert keras.config.dtype_policy().name == "mixed_float16"
    dense = keras.layers.Dense(3)
    dense.build((None, 2))
    assert dense.compute_dtype == "float16"
    assert dense.kernel.dtype == "float32"


def test_get_policy_follows_keras_when_keras_is_set_directly():
    kmp.set_policy("mixed_float16")
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert kmp.get_policy() == policy_lib.get("mixed_bfloat16")


def test_get_policy_does_not_write():
    keras.config.set_dtype_policy("bfloat16")
    before = keras.config.dtype_policy()
    kmp.get_policy()
    assert keras.config.dtype_policy() is before


def test_policy_scope_restores_previous_policy_even_when_body_raises():
    kmp.set_policy("mixed_bfloat16")
    with pytest.raises(RuntimeError), kmp.policy_scope("mixed_float16") as inside:
        assert inside.name == "mixed_float16"
        assert keras.layers.Dense(2).compute_dtype == "float16"
        raise RuntimeError("boom")
    assert kmp.get_policy().name == "mixed_bfloat16"
    assert keras.layers.Dense(2).compute_dtype == "bfloat16"


def test_nested_policy_scopes_restore_in_order():
    with kmp.policy_scope("mixed_float16"):
        with kmp.policy_scope("bfloat16"):
            assert kmp.get_policy().name == "bfloat16"
        assert kmp.get_policy().name == "mixed_float16"
    assert kmp.get_policy().name == "float32"


def test_registered_policy_keeps_its_name_and_sets_keras_dtypes():
    fast = kmp.register_policy(kmp.Policy("fast", "bfloat16", "float32"))
    assert "fast" in policy_lib.list_policies()
    assert kmp.set_policy("fast") is fast
    assert kmp.get_policy() is fast
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    assert keras.layers.Dense(2).compute_dtype == "bfloat16"


def test_registering_the_same_policy_twice_is_harmless():
    policy = kmp.Policy("fast", "bfloat16", "float32")
    kmp.register_policy(policy)
    assert kmp.register_policy(kmp.Policy("fast", "bfloat16", "float32")) == policy


@pytest.mark.parametrize("name", ["fast", "mixed_float16"])
def test_registering_a_taken_name_with_another_meaning_raises(name):
    kmp.register_policy(kmp.Policy("fast", "bfloat16", "float32"))
    with pytest.raises(kmp.PolicyError, match="already registered"):
        kmp.register_policy(kmp.Policy(name, "float32", "float32"))


def test_auto_cannot_be_registered():
    with pytest.raises(kmp.PolicyError, match="reserved"):
        kmp.register_policy(kmp.Policy("auto", "float32", "float32"))


def test_register_policy_rejects_non_policies():
    with pytest.raises(TypeError, match=r"expects a kmp\.Policy"):
        kmp.register_policy("mixed_float16")


def test_auto_resolves_from_this_machines_cpu_flags():
    if kmp.hardware.capabilities().gpus:
        pytest.skip("a GPU, not the CPU flags, decides 'auto' on this machine")
    # Read the flags independently of kmp.
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    fast = "amx_bf16" in flags or "avx512_bf16" in flags
    # On JAX's CPU code no 16-bit policy is faster: 'auto' picks float32.
    tensorflow = keras.backend.backend() == "tensorflow"
    expected = "mixed_bfloat16" if fast and tensorflow else "float32"
    assert kmp.set_policy("auto").name == expected
    assert kmp.get_policy().name == expected


def test_kmp_policy_environment_variable_overrides_auto(monkeypatch):
    monkeypatch.setenv("KMP_POLICY", "mixed_float16")
    assert kmp.set_policy("auto").name == "mixed_float16"
    assert "KMP_POLICY" in machine.resolve_auto().reason


def test_a_bad_kmp_policy_environment_variable_is_named_in_the_error(monkeypatch):
    monkeypatch.setenv("KMP_POLICY", "mixed_fp16")
    with pytest.raises(kmp.PolicyError, match=r"KMP_POLICY.*Valid names"):
        kmp.set_policy("auto")


@pytest.mark.parametrize(
    "gpus, flags, expected",
    [
        ([], frozenset({"avx512_bf16"}), "mixed_bfloat16"),
        ([], frozenset({"amx_bf16"}), "mixed_bfloat16"),
        ([], frozenset({"avx512_fp16"}), "float32"),
        ([], frozenset(), "float32"),
        ([("A100", (8, 0))], frozenset(), "mixed_bfloat16"),
        ([("V100", (7, 0))], frozenset({"amx_bf16"}), "mixed_float16"),
        ([("P100", (6, 0))], frozenset({"amx_bf16"}), "float32"),
        ([("A100", (8, 0)), ("T4", (7, 5))], frozenset(), "mixed_float16"),
    ],
)
def test_auto_rule(gpus, flags, expected):
    choice = auto.choose_policy(gpus, flags)
    assert choice.policy == expected
    assert choice.reason


def test_cpu_flags_are_read_from_the_os(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile amx_bf16\n"
    )
    assert machine.read_cpu_flags(str(cpuinfo)) == {
        "fpu",
        "sse",
        "avx512f",
        "avx512_bf16",
        "amx_tile",
        "amx_bf16",
    }
    assert machine.read_cpu_flags(str(tmp_path / "missing")) == frozenset()


@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16"])
def test_user_written_layer_honours_the_policy_without_kmp_code(name):
    class Scale(keras.layers.Layer):
        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1], 3), initializer="ones")

        def call(self, x):
            return keras.ops.matmul(x, self.w)

    kmp.set_policy(name)
    layer = Scale()
    y = layer(np.ones((2, 4), "float32"))
    compute = policy_lib.get(name).compute_dtype
    assert layer.w.dtype == "float32"
    assert keras.backend.standardize_dtype(y.dtype) == compute
    np.testing.assert_allclose(np.asarray(y, "float32"), 4.0)
