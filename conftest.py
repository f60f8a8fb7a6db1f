"""Test set-up shared by the suite and the docstring examples."""

import gc
import importlib.abc
import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Imported where tests are collected (`_start_tensorflow`): pytest-xdist's
# controller, which runs no test, starts no TensorFlow (a few seconds before
# its workers can start).
tf = keras = np = kmp = policy_lib = None


def pytest_collectstart(collector):
    if kmp is None:
        _start_tensorflow()


class _NoTensorFlow(importlib.abc.MetaPathFinder):
    """Fails every import of TensorFlow, as where it is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def _start_tensorflow():
    """Imports TensorFlow, Keras and kmp for the tests, before the first
    test module is imported. Under Keras's JAX backend the tests run as on a
    machine without TensorFlow: kmp must not need it there."""
    global tf, keras, np, kmp, policy_lib
    if os.environ.get("KERAS_BACKEND") == "jax":
        sys.meta_path.insert(0, _NoTensorFlow())
    else:
        _configure_tensorflow()

    import keras
    import numpy as np

    import kmp
    from kmp.precision import policy as policy_lib


def _configure_tensorflow():
    global tf
    import tensorflow as tf

    # Two logical CPUs, so that MirroredStrategy tests have two replicas.
    # This must happen before TensorFlow's runtime starts (its first op).
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [
            tf.config.LogicalDeviceConfiguration(),
            tf.config.LogicalDeviceConfiguration(),
        ],
    )
    # Every device platform starts here, before any test captures standard
    # error: where TensorFlow probes CUDA only when GPUs are listed, its
    # cuInit notice would otherwise land in the first test that lists them.
    tf.config.list_physical_devices()
    # float32 references must be float32: no TF32 on GPUs that have it.
    tf.config.experimental.enable_tensor_float_32_execution(False)


_MIRRORED = []


@pytest.fixture
def mirrored() -> "tf.distribute.MirroredStrategy":
    """One MirroredStrategy over the two logical CPUs for the whole process:
    each new one would restart the collective-op instance keys on the same
    device group, and TF 2.21 then mixes up the collectives of different
    strategies."""
    assert len(tf.config.list_logical_devices("CPU")) >= 2
    if not _MIRRORED:
        _MIRRORED.append(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    return _MIRRORED[0]


@pytest.fixture
def runs_in_this_process(monkeypatch):
    """`kmp bench` and `kmp demo` run each policy here instead of in a fresh
    process: the same call and the same JSON round trip, one TensorFlow
    start-up less per run. For tests of what the runs compute, not of the
    processes themselves (each run sets its own policy first)."""
    import importlib
    import json

    from kmp.tools import runs

    def in_this_process(function, args, timeout, what, show_output):
        module, name = function.split(":")
        call = getattr(importlib.import_module(module), name)
        return json.loads(json.dumps(call(*json.loads(json.dumps(args)))))

    monkeypatch.setattr(runs, "in_fresh_process", in_this_process)


@pytest.fixture(autouse=True)
def _restore_kmp_state():
    """Every test starts at float32 with no rules, and leaves nothing behind."""
    _reset()
    keras.utils.set_random_seed(0)
    yield
    _reset()


def _reset():
    kmp.set_policy("float32")  # also undoes kmp's CPU fast-path settings
    policy_lib._last_set = None
    kmp.clear_layer_policies()
    kmp.rules.set_attention_scores("auto")
    kmp.rules.set_cpu_convolutions("speed")
    kmp.precision.kinds._clear_registrations()
    policy_lib._unregister_user_policies()


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update(kmp=kmp, keras=keras, np=np, tf=tf)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Collect this test's garbage, then freeze what lives on out of the
    collector's reach.

    TensorFlow keeps every traced train step whose graph used a custom
    gradient (Keras's optimizer all-reduces its gradients through one, also
    with no strategy) in its global gradient registry, so a worker's heap
    grows by a graph with each test that trains. Every full collection (and
    Keras calls `gc.collect()` at each variable it deletes, in `quantize`
    among others) would then scan them all again: a quarter of the suite's
    time went to the collector. Frozen objects are never scanned again, and
    never collected if a later test drops them inside a reference cycle (a
    Keras model is one): so fixtures stay function-scoped here, and what a
    test keeps for later tests (a cached reference run) lives to the end."""
    gc.collect()
    gc.freeze()
