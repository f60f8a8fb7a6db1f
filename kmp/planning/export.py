"""`kmp.export`: a trained model written for 16-bit inference.

Training keeps float32 variables; inference needs none of them. The export
is the model rebuilt from its config with every 16-bit policy made pure
16-bit (`mixed_bfloat16` becomes `bfloat16`: 16-bit variables too), and
every float32 layer of the plan left float32. kmp's own layer classes
(`kmp.layers`, which keep less for the backward pass) become the Keras
classes they extend. Its weights are the trained ones, cast. It has no
optimizer, and plain Keras and TensorFlow load it.
"""

from __future__ import annotations

import os
from typing import Any

import keras
import numpy as np

from kmp.backend import outputs
from kmp.backend import ranges as ranges_lib
from kmp.planning import applied
from kmp.planning import decisions
from kmp.precision import policy as policy_lib

_FLOAT16_MAX = 65504.0
# The Keras names of the policies that compute in 16 bits.
_SIXTEEN = {"mixed_float16", "mixed_bfloat16", "float16", "bfloat16"}


def export(
    model: keras.Model,
    path: str | os.PathLike,
    dtype: str = "bfloat16",
    *,
    sample: Any = None,
) -> keras.Model:
    """Writes `model` for inference in 16 bits, without kmp or an optimizer.

    Every layer that computes in 16 bits gets the pure 16-bit policy
    `dtype`, so its variables are 16-bit too: half the memory of the
    trained model's float32 ones. Every layer that computes in float32
    (by kmp's rules for the policy it trained in, or your own) keeps its
    float32 variables. Predictions match the trained model's within 16-bit
    rounding. `dtype="float16"` is refused, with the layers named, where a
    weight or an activation would pass float16's largest value (65504).
    A model trained in bfloat16 and exported in float16 keeps its
    bfloat16 plan: kmp's float16 rules (attention scores in float32) are
    for training in float16. A layer computed in float32 for speed on this
    machine alone (a float16 convolution on a CPU) is exported in `dtype`.

    kmp's layers (`kmp.layers.lean`) are written as the Keras layers they
    extend, which compute the same forward pass. A sublayer that a layer's
    own code creates without passing its `dtype` on takes the global policy
    where the file is loaded (float32, unless the loading code sets
    another): the model `kmp.export` returns is built so too.

    Args:
        model: A built Keras model.
        path: Where to write it. A path ending in `.keras` gets a Keras file
            (`keras.models.load_model` reads it). Any other path gets a
            TensorFlow SavedModel folder, through Keras's `model.export`,
            for TensorFlow Serving.
        dtype: `"bfloat16"` or `"float16"`.
        sample: A batch of inputs. A float16 export needs one where the
            model did not compute in float16 (another policy, or float32
            convolutions on a CPU): kmp runs it to check that no activation
            passes float16's range.

    Returns:
        The exported model, as written. Its `predict` returns float32.

    Raises:
        TypeError: if `model` is not a Keras model; Keras's own, where a
            class in it is not registered for serialization.
        ValueError: for another `dtype`, a model that is not built or has
            no layer computing in 16 bits, a float16 export without `sample`
            where one is needed, or weights or activations beyond float16's
            range.

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "model.keras")
    >>> exported = kmp.export(model, path)
    >>> exported.layers[0].kernel.dtype
    'bfloat16'
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "kmp.export expects a Keras model. Received: "
            f"{model!r} (of type {type(model).__name__})."
        )
    if dtype not in policy_lib.SIXTEEN_BIT:
        raise ValueError(
            f"kmp.export writes a 16-bit model: dtype must be 'bfloat16' or "
            f"'float16'. Received: dtype={dtype!r}."
        )
    if not model.built:
        raise ValueError(
            f"kmp.export needs the weights of {model.name!r}, which is not "
            "built. Call it on a batch (or train it) first."
        )
    # Layers in float32 for speed on this machine alone (float16
    # convolutions on a CPU) are exported in 16 bits, as their policy says.
    the_plan = decisions.plan(model)
    for_speed = {d.path for d in the_plan if d.rule == decisions.CPU_CONVOLUTIONS}
    base = applied.base_policy(model)
    computes = base.compute_dtype
    if not for_speed and not any(
        d.layer.compute_dtype in policy_lib.SIXTEEN_BIT for d in the_plan
    ):
        raise ValueError(
            f"kmp.export writes in 16 bits the layers that compute in 16 "
            f"bits, and no layer of {model.name!r} does (its policy is "
            f"{base.name}). Build and train it under a "
            "mixed policy (kmp.set_policy('mixed_bfloat16')) first."
        )
    if dtype == "float16" and sample is None and (computes != "float16" or for_speed):
        where = (
            f"it computes in {computes}"
            if computes != "float16"
            else f"{len(for_speed)} layer{'s' * (len(for_speed) > 1)} computed in "
            "float32 on this machine"
        )
        raise ValueError(
            f"kmp.export cannot tell whether the activations of {model.name!r} "
            f"fit float16: {where}, and float16's largest value is 65504. Pass "
            "sample=<a batch of inputs>, or export with dtype='bfloat16'."
        )
    config = keras.saving.serialize_keras_object(model)
    config.pop("compile_config", None)  # no optimizer, no loss
    exported = _rebuilt(model, config, dtype, for_speed)
    if dtype == "float16":
        # The activations are read in a float32 pass (kmp.backend.ranges),
        # which needs float32 variables: on a mixed twin of the export.
        twin = None
        if sample is not None:
            twin = _rebuilt(model, config, "mixed_float16", for_speed)
        _check_float16(exported, twin, sample)
    if os.fspath(path).endswith(".keras"):
        exported.save(path)
    else:
        exported.export(path, verbose=False)
    outputs.install(exported)
    return exported


def _for_inference(
    config: Any, dtype: str, for_speed: set[str], prefix: str | None = None
) -> Any:
    """`config` with every 16-bit policy in it (a layer's, a map's entry,
    a quantized policy's float part) replaced by the policy `dtype`, as are
    the policies of the layers at the paths in `for_speed`, and kmp's layer
    classes by the Keras classes they extend. `prefix`: the path above
    `config`'s layers (None at the model itself, whose name is in none)."""
    if isinstance(config, list):
        return [_for_inference(item, dtype, for_speed, prefix) for item in config]
    if not isinstance(config, dict):
        return config
    inner = config.get("config")
    path, below = None, prefix
    if (
        "class_name" in config
        and isinstance(inner, dict)
        and isinstance(inner.get("name"), str)
        and not str(config["class_name"]).endswith("DTypePolicy")
    ):  # a layer's or a model's
        path = None if prefix is None else prefix + inner["name"]
        below = "" if prefix is None else path + "/"
    config = {
        key: _for_inference(value, dtype, for_speed, below)
        for key, value in config.items()
    }
    if path is not None and path in for_speed:
        config["config"]["dtype"] = keras.dtype_policies.serialize(
            keras.DTypePolicy(dtype)
        )
    if _extends_keras(config):
        # kmp.layers keep less for the backward pass: inference has none.
        config["module"], config["registered_name"] = "keras.layers", None
    inner = config.get("config")
    if isinstance(inner, dict) and str(config.get("class_name", "")).endswith(
        "DTypePolicy"
    ):
        for key in ("name", "source_name"):
            if isinstance(inner.get(key), str) and inner[key] in _SIXTEEN:
                inner[key] = dtype
    if isinstance(config.get("dtype"), str) and config["dtype"] in _SIXTEEN:
        # a policy saved by its name
        config["dtype"] = dtype
    return config


def _extends_keras(config: dict) -> bool:
    """Whether `config` is of a kmp layer class that extends the Keras layer
    of the same name (`kmp.layers.LayerNormalization`), with its config."""
    registered = config.get("registered_name")
    if not (isinstance(registered, str) and registered.startswith("kmp>")):
        return False
    cls = keras.saving.get_registered_object(registered)
    base = getattr(keras.layers, str(config.get("class_name")), None)
    return isinstance(cls, type) and isinstance(base, type) and issubclass(cls, base)


def _copy_weights(model: keras.Model, exported: keras.Model) -> None:
    """Assigns `model`'s weights to `exported`'s, in Keras's order, each
    checked by its name and shape."""
    pairs = list(zip(exported.weights, model.weights, strict=False))
    differ = [
        ((target.path, tuple(target.shape)), (source.path, tuple(source.shape)))
        for target, source in pairs
        if (target.name, tuple(target.shape)) != (source.name, tuple(source.shape))
    ]
    if len(exported.weights) != len(model.weights) or differ:
        first = ""
        if differ:
            (t_name, t_shape), (s_name, s_shape) = differ[0]
            first = f", first {s_name} {s_shape} rebuilt as {t_name} {t_shape}"
        raise ValueError(
            f"kmp.export rebuilt {model.name!r} from its config, and the "
            f"rebuilt weights differ from the model's: {len(exported.weights)} "
            f"against {len(model.weights)}{first}. Its config does not "
            "describe it: check its get_config, and that its layers build "
            "from their config."
        )
    for target, source in pairs:
        target.assign(keras.ops.cast(source, target.dtype))


def _rebuilt(model: keras.Model, config: dict, policy: str, for_speed) -> keras.Model:
    """`model` built again from `config` with its 16-bit layers in `policy`,
    holding `model`'s weights."""
    # As plain Keras loads the file: a sublayer made with no dtype takes the
    # global policy, float32 unless the loading code sets another.
    with policy_lib.policy_scope("float32"):
        rebuilt = keras.saving.deserialize_keras_object(
            _for_inference(config, policy, for_speed)
        )
    _copy_weights(model, rebuilt)
    return rebuilt


def _check_float16(exported: keras.Model, twin: keras.Model | None, sample) -> None:
    """Raises where a float16 weight of `exported`, or an activation of its
    mixed `twin` on `sample`, passes float16's range, naming them."""
    beyond = [
        f"the weight {weight.path!r}"
        for weight in exported.weights
        if weight.dtype == "float16"
        and not np.isfinite(keras.ops.convert_to_numpy(weight)).all()
    ]
    if sample is not None:
        ranges = ranges_lib.activation_ranges(twin, sample, float16_only=True)
        if ranges.error:
            raise ValueError(
                f"kmp.export could not run {exported.name!r} on `sample` to "
                f"check its float16 range: {ranges.error}"
            )
        beyond += [
            f"{r.path!r} ({r.op} reaches {r.max_abs:.3g})"
            for r in ranges.above(_FLOAT16_MAX)
        ]
    if beyond:
        raise ValueError(
            "kmp.export refused a float16 model: values pass float16's "
            f"largest, 65504, in {', '.join(beyond)}. Export with "
            "dtype='bfloat16', or keep those layers (a weight's path "
            "starts with its layer's) in float32 "
            "(kmp.set_layer_policy('name:<layer>', 'float32'), then "
            "kmp.prepare(model)) and export again."
        )
