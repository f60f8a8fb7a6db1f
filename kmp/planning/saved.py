"""The plan saved with the model: the policies kmp set on the layers that a
layer's own code creates, written into that layer's `dtype` as a Keras
`DTypePolicyMap`, so that `keras.models.load_model` gives them back, with
kmp or without it.

A Functional or Sequential model's config lists its layers, each with its
policy, so Keras saves those as they are. Any other layer with sublayers
(Keras's attention layers, a KerasHub block, a custom layer)
saves only its own `dtype`: its code creates its sublayers again on load.
Keras's attention layers and KerasHub's hand that `dtype` on to the
sublayers they create, and Keras looks a layer's policy up in it by the
layer's path. So kmp makes it a map: its default is the layer's own policy,
and it has an entry for each sublayer whose policy differs.

An entry's key is the sublayer's path from the holder on, below any
prefix (a Sequential model's name, which loading drops). Keras gives no
path to a sublayer it never builds (a `Softmax` or a `Dropout`): such a
sublayer takes the map's default, the holder's own policy, on load.

Models keep their plain policies: Keras's `compile` reads a model's policy
by its name, and a KerasHub task takes its backbone's. So does a layer
with no `get_config` of its own: Keras's automatic config holds plain
values only.

A layer reads a policy from a map only where a saved plan (or KerasHub's
own map) put it there, so kmp's plan takes such a policy for the plan's,
never for the user's own `dtype=` (see `kmp.planning.decisions`). A layer
whose policy is the user's own setting keeps it plain.

Example:

>>> kmp.set_policy("mixed_float16")
<Policy "mixed_float16": ...>
>>> inputs = keras.Input((4, 8))
>>> attention = keras.layers.MultiHeadAttention(2, 4, name="attention")
>>> model = kmp.prepare(keras.Model(inputs, attention(inputs, inputs)))
>>> attention.compute_dtype  # its scores: float32
'float32'
>>> for key, name in kmp.planning.saved.entries(attention).items():
...     print(key, name)  # what its config saves
(?:.*/)?attention/attention_output mixed_float16
(?:.*/)?attention/value mixed_float16
"""

from __future__ import annotations

import re

import keras

from kmp.internals import keras_private
from kmp.planning import applied
from kmp.planning import decisions
from kmp.precision import quantization

_Map = keras.dtype_policies.DTypePolicyMap


def write(model: keras.layers.Layer) -> None:
    """Writes the policies of `model`'s layers into the `dtype` of each layer
    whose code creates them (see the module docstring). Live layers keep
    the policies they have."""
    base = applied.base_policy(model)
    written: set[int] = set()  # the maps written, shared ones once
    for holder in keras_private.sublayers(model, include_self=True):
        held = holder.dtype_policy
        if not _saves_a_map(holder) or id(held) in written:
            continue
        if not holder.path or decisions.is_explicit(holder, base):
            continue  # not built, or the user's: it stays plain
        inside = [
            layer
            for layer in keras_private.sublayers(holder)
            if not isinstance(layer, keras.layers.InputLayer)
        ]
        if not inside:
            continue
        if isinstance(held, _Map):
            _update(holder, held, inside)
        else:
            _create(holder, held, inside)
        if isinstance(holder.dtype_policy, _Map):
            written.add(id(holder.dtype_policy))


def _saves_a_map(holder: keras.layers.Layer) -> bool:
    """Whether `holder`'s config can carry a map for its sublayers. Not a
    model's: Keras's `compile` reads a model's policy by its name to wrap
    the optimizer under float16, and a KerasHub task takes its backbone's.
    Not a Functional or Sequential model's config, which lists its layers.
    Not Keras's automatic config of a layer with no `get_config`, which
    holds only plain values: a layer loaded with a map could not be saved
    again."""
    return not isinstance(holder, keras.Model) and keras_private.has_own_config(holder)


def entries(holder: keras.layers.Layer) -> dict[str, str]:
    """The sublayer policies `holder`'s `dtype` saves, {key: policy name},
    sorted by key: empty where it holds a plain policy."""
    held = holder.dtype_policy
    if not isinstance(held, _Map):
        return {}
    return {key: held[key].name for key in sorted(held)}


def _keys(holder: keras.layers.Layer, layers: list) -> dict[str, str]:
    """{path: key} for `layers` (the holder and sublayers with a path): each
    key the path from the holder's own name on, matched below any prefix
    (a Sequential model's name, which loading drops); a path outside the
    holder's (a sublayer built elsewhere) as it
    is. Exact paths where a suffix key would match two of them."""
    own = holder.path or ""
    start = len(own) - len(holder.name)
    keys = {}
    for layer in layers:
        path = layer.path
        inside = path == own or path.startswith(own + "/")
        if own.endswith(holder.name) and inside:
            keys[path] = "(?:.*/)?" + re.escape(path[start:])
        else:
            keys[path] = re.escape(path)
    paths = list(keys)
    if any(sum(bool(re.fullmatch(k, p)) for k in keys.values()) > 1 for p in paths):
        return {path: re.escape(path) for path in paths}
    return keys


def _create(holder, own: keras.DTypePolicy, inside: list) -> None:
    layers = [layer for layer in [holder, *inside] if layer.path]
    keys = _keys(holder, layers)
    differ = {
        keys[layer.path]: _copy(quantization.policy_of(layer))
        for layer in layers
        if not _same(quantization.policy_of(layer), own)
    }
    if differ:  # through Keras's public setter; the layer's own is the default
        holder.dtype_policy = _Map(default_policy=_copy(own), policy_map=differ)


def _update(holder, held: _Map, inside: list) -> None:
    """Rewrites `held` in place: a layer holding a map gives a new one to its
    own entry. A sublayer sharing `held` (one loaded, or KerasHub's) reads
    its own entry throughout, as each is put back at once. The default
    stays: a sublayer with no path keeps the one the map was made with."""
    layers = [layer for layer in [holder, *inside] if layer.path]
    keys = _keys(holder, layers)
    for layer in layers:
        wanted = _copy(quantization.policy_of(layer))
        for old in {keys[layer.path], layer.path}:
            if old in held:
                del held[old]
        if not _same(held[layer.path], wanted):
            held[keys[layer.path]] = wanted


def _same(a: keras.DTypePolicy, b: keras.DTypePolicy) -> bool:
    return (type(a), a.compute_dtype, a.variable_dtype, a.quantization_mode) == (
        type(b),
        b.compute_dtype,
        b.variable_dtype,
        b.quantization_mode,
    )


def _copy(policy: keras.DTypePolicy) -> keras.DTypePolicy:
    # A map renames the policies it holds when it is saved without a default
    # (`DTypePolicyMap.get_config`): never one a layer holds.
    return keras.dtype_policies.deserialize(keras.dtype_policies.serialize(policy))
