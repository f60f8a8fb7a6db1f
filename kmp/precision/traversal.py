"""The layers of a model as kmp sees them: one traversal, shared by the
precision rules, the report and the debugging tools.

A layer's precision can be changed safely only where the code that consumes
its output copes with a new dtype. TensorFlow never promotes mixed dtypes in
raw ops (`float32 + float16` raises), and users write raw ops inside their
own layers. So each layer is visited as a `Site` that says who consumes what
it returns:

* In a Functional or Sequential graph, a layer's output goes to other Keras
  layers and to `keras.ops` nodes. A Keras layer casts its inputs to its own
  compute dtype (or, like `LayerNormalization` and `Embedding`, casts them
  itself); a nested Functional model converts its inputs to its `Input`
  dtypes; a `keras.ops` node either fixes its output dtype (`cast`,
  comparisons), or computes in the dtype of its inputs, promoting mixed
  ones (`add`, `matmul`, `reshape`, ...): then its own consumers are checked
  in turn. Some ops do neither (`slice_update`, `scatter_update` raise on
  mixed dtypes): they, and ops kmp does not know, count as not absorbing.
  Where every path ends in something that absorbs a dtype change,
  `Site.casts_downstream` is True.
* Inside a user's `Layer.call` or a subclassed `Model.call`, the output goes
  to code kmp cannot see: `casts_downstream` is False, and kmp never changes
  what such a layer returns.

Keras 3 has no public API for a layer's sublayers or a graph's nodes; this
module reads `Layer._flatten_layers` (what Keras's own `Model.layers` uses)
and the Functional graph's nodes, and never writes them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import keras

from kmp.internals import keras_private
from kmp.precision.policy import SIXTEEN_BIT

# keras.ops nodes whose output dtype follows their inputs' (promoting mixed
# ones): a dtype change passes through them to their consumers.
PASS_THROUGH_OPS = frozenset(
    (
        "Absolute Fabs Add Amax Amin Average Cbrt Ceil Clip Concatenate Copy Cos "
        "Cosh Cumprod Cumsum Diag Diagonal Diff Dot Einsum Exp Exp2 ExpandDims "
        "Expm1 Flip Floor GetItem Hstack Log Log10 Log1p Log2 Logaddexp Matmul "
        "Max Maximum Mean Median Min Minimum Moveaxis Negative Outer Pad Prod "
        "Ravel Reciprocal Repeat Reshape Roll Round Sign Sin Sinh Sqrt Square "
        "Squeeze Stack Std Subtract Sum Swapaxes Take TakeAlongAxis Tan Tanh "
        "Tensordot Tile Transpose Tril Triu Trunc Var Vstack Where Multiply "
        "Divide DivideNoNan TrueDivide Power Select Split Relu Relu6 Sigmoid "
        "Softplus Softsign Silu LogSigmoid LeakyRelu HardSigmoid HardSilu Elu "
        "Selu Gelu Celu Glu Softmax LogSoftmax MaxPool AveragePool Conv "
        "DepthwiseConv SeparableConv ConvTranspose Normalize Slice StopGradient "
        "Unstack Rsqrt Erf Logsumexp"
    ).split()
)
# keras.ops nodes whose output dtype does not depend on their inputs'.
ABSORBING_OPS = frozenset(
    (
        "Cast SaturateCast Equal NotEqual Greater GreaterEqual Less LessEqual "
        "Isfinite Isnan Isinf Argmax Argmin Argsort LogicalAnd LogicalOr "
        "LogicalNot LogicalXor Size Ndim"
    ).split()
)


@dataclasses.dataclass(frozen=True)
class Site:
    """Where a layer sits in a model.

    Attributes:
        path: The layer's path inside the model (`"block/attn/query"`); a
            layer reachable by several paths is visited at its first.
        layer: The layer.
        parent: The layer or model whose `call` calls it.
        in_graph: True when a Functional or Sequential graph calls it (not
            user code).
        casts_downstream: True when every path its output takes ends in
            something that absorbs a dtype change (see the module
            docstring) or in an output of the top model; only then may kmp
            change the dtype it returns.
        model_output: True when it produces an output of the top model
            (directly, or through ops that keep its dtype), or of a model
            the top model's training code calls (`walk`'s `called`: a VAE's
            encoder, whose outputs go to its `train_step` as a top model's
            go to the loss).
        output_of: The model whose output it produces (the top model, or
            one of `called`), or None.
        user_code: The nearest enclosing layer whose own Python code calls
            it (a custom `Layer` or a subclassed `Model`), or None.
        reads_float_input: True when it consumes a float `keras.Input` of
            the top model directly.
        blocker: When `casts_downstream` is False in a graph, the consumer
            that does not absorb a dtype change (its class name).
    """

    path: str
    layer: keras.layers.Layer
    parent: keras.layers.Layer | None
    in_graph: bool
    casts_downstream: bool
    model_output: bool
    user_code: keras.layers.Layer | None = None
    reads_float_input: bool = False
    blocker: str = ""
    output_of: keras.layers.Layer | None = None


def children(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The direct sublayers of `layer` (input layers left out)."""
    return [
        child
        for child in keras_private.sublayers(layer, recursive=False)
        if not isinstance(child, keras.layers.InputLayer)
    ]


def has_own_call(layer: keras.layers.Layer) -> bool:
    """False for a `keras.Model` subclass that defines no `call` (a GAN or a
    VAE written with a `train_step` only)."""
    return not isinstance(layer, keras.Model) or type(layer).call is not (
        keras.Model.call
    )


def training_code(model: keras.layers.Layer) -> list[str]:
    """The training methods a `keras.Model` subclass defines itself, of
    `train_step` and `compute_loss`."""
    if not isinstance(model, keras.Model):
        return []
    return [
        name
        for name in ("train_step", "compute_loss")
        if getattr(type(model), name) is not getattr(keras.Model, name)
    ]


def code_of(layer: keras.layers.Layer | None) -> str:
    """The user code in `layer` that consumes its sublayers' outputs, by
    the name of a method that exists: `'Net.call'`, or for a model with no
    call of its own `'VAE.train_step'` (or `compute_loss`)."""
    if layer is None:
        return "user code"
    name = type(layer).__name__
    if not has_own_call(layer):
        methods = training_code(layer)
        if methods:
            return f"{name}.{methods[0]}"
        return f"the code that calls {name}'s models"
    return f"{name}.call"


def is_graph(model: keras.layers.Layer) -> bool:
    """True for a Functional model or a Sequential one: a graph Keras runs,
    casting at every layer boundary."""
    if isinstance(model, keras.Sequential):
        return True
    return isinstance(model, keras.Model) and (
        keras_private.graph_nodes(model) is not None
    )


def _layer_absorbs(layer: keras.layers.Layer) -> bool:
    """Whether a consuming layer absorbs a change of its inputs' dtype."""
    if is_graph(layer) and not isinstance(layer, keras.Sequential):
        return True  # a Functional model converts inputs to its Input dtypes
    if isinstance(layer, keras.layers.Embedding):
        return True  # casts its inputs to int32
    if isinstance(
        layer,
        (
            keras.layers.LayerNormalization,
            keras.layers.GroupNormalization,
            keras.layers.BatchNormalization,
        ),
    ):
        return True  # casts to float32 inside and back to its compute dtype
    return bool(
        layer.autocast
        and keras_private.converts_input_args(layer)
        and keras.backend.is_float_dtype(layer.compute_dtype)
    )


def _blocker(operation, consumers, outputs_absorb: bool) -> str:
    """'' when `operation` (a consumer; None for an output of the graph)
    absorbs a dtype change on every path, else the class name of the first
    consumer on the way that does not."""
    if operation is None:
        return "" if outputs_absorb else "the code its model's output goes to"
    if isinstance(operation, keras.layers.Layer):
        return "" if _layer_absorbs(operation) else type(operation).__name__
    name = type(operation).__name__
    if name in ABSORBING_OPS:
        return ""
    if name in PASS_THROUGH_OPS:
        for consumer in consumers.get(id(operation), []):
            blocker = _blocker(consumer, consumers, outputs_absorb)
            if blocker:
                return blocker
        return ""
    return f"keras.ops {name}"


def _graph_consumers(model: keras.Model) -> dict[int, list]:
    """id(producer operation) -> the operations consuming its outputs in
    `model`'s graph; `None` in the list marks an output of `model`."""
    consumers: dict[int, list] = {}
    if isinstance(model, keras.Sequential):
        layers = children(model)
        for this, following in itertools.pairwise(layers):
            consumers.setdefault(id(this), []).append(following)
        if layers:
            consumers.setdefault(id(layers[-1]), []).append(None)
        return consumers
    for nodes in keras_private.graph_nodes(model).values():
        for node in nodes:
            if node.is_input:
                continue
            for tensor in node.input_tensors:
                producer = keras_private.producer(tensor)
                consumers.setdefault(id(producer), []).append(node.operation)
    for tensor in keras.tree.flatten(model.outputs):
        producer = keras_private.producer(tensor)
        consumers.setdefault(id(producer), []).append(None)
    return consumers


def output_producers(model: keras.Model) -> set[int]:
    """ids of the layers whose dtype reaches an output of `model`: the
    layer that produces an output, or the layers before ops that keep their
    inputs' dtype (`ops.squeeze(dense(x))`)."""
    if isinstance(model, keras.Sequential):
        layers = children(model)
        return {id(layers[-1])} if layers else set()
    found: set[int] = set()
    seen: set[int] = set()
    stack = [keras_private.producer(t) for t in keras.tree.flatten(model.outputs)]
    while stack:
        operation = stack.pop()
        if id(operation) in seen:
            continue
        seen.add(id(operation))
        if isinstance(operation, keras.layers.InputLayer):
            continue
        if isinstance(operation, keras.layers.Layer):
            found.add(id(operation))
        elif type(operation).__name__ in PASS_THROUGH_OPS:
            for node in keras_private.inbound_nodes(operation):
                stack.extend(keras_private.producer(t) for t in node.input_tensors)
    return found


def walk(
    model: keras.layers.Layer, called: frozenset[int] = frozenset()
) -> Iterator[Site]:
    """Yields a `Site` for every layer inside `model`, depth first, each layer
    once (at its first path). Input layers are left out.

    `called`: ids of the Functional or Sequential models that `model`'s
    own code calls and hands their outputs to its training code (a VAE's
    encoder and decoder): their output layers are sites of model outputs,
    as the top model's are (`Site.output_of`).

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
    >>> [(s.path, s.in_graph, s.casts_downstream, s.model_output)
    ...  for s in kmp.precision.traversal.walk(model)]
    [('d', True, True, True)]
    """
    sites: dict[int, Site] = {}
    top_user = None if is_graph(model) else model
    float_inputs = _float_input_readers(model)
    for site in _walk(model, "", model, True, top_user, called):
        if id(site.layer) in float_inputs and site.parent is model:
            site = dataclasses.replace(site, reads_float_input=True)
        first = sites.get(id(site.layer))
        if first is None:
            sites[id(site.layer)] = site
        else:
            # A shared layer is safe only where every call site is safe, and
            # is a model output where any call site is.
            sites[id(site.layer)] = dataclasses.replace(
                first,
                casts_downstream=first.casts_downstream and site.casts_downstream,
                model_output=first.model_output or site.model_output,
                output_of=first.output_of or site.output_of,
                blocker=first.blocker or site.blocker,
            )
    yield from sites.values()


def _walk(container, prefix, output_of, outputs_absorb, user, called):
    """Sites of `container`'s sublayers. `output_of`: the model whose
    outputs `container`'s outputs are (the top model, or one in `called`),
    or None; `outputs_absorb`: whatever consumes its outputs absorbs a
    dtype change; `user`: the nearest enclosing layer whose own code runs;
    `called`: see `walk`."""
    graph = is_graph(container)
    consumers = _graph_consumers(container) if graph else {}
    producers = output_producers(container) if graph else set()
    for child in children(container):
        path = f"{prefix}{child.name}"
        casts, is_output, blocker = False, False, ""
        if graph:
            # A layer that feeds an output is safe to change only where the
            # code after the outputs absorbs it (a model's outputs: always).
            ends = output_of is not None or outputs_absorb
            blocker = next(
                (
                    b
                    for op in consumers.get(id(child), [])
                    if (b := _blocker(op, consumers, ends))
                ),
                "",
            )
            casts = not blocker
            is_output = id(child) in producers and output_of is not None
        yield Site(
            path,
            child,
            container,
            graph,
            casts,
            is_output,
            user,
            False,
            blocker,
            output_of if is_output else None,
        )
        if is_graph(child):
            if graph:
                inner = output_of if is_output else None
            else:
                # A model the training code calls hands its outputs to it,
                # as the top model hands its outputs to the loss.
                inner = child if id(child) in called else None
            yield from _walk(child, path + "/", inner, casts, user, called)
        else:
            yield from _walk(child, path + "/", None, False, child, called)


def _float_input_readers(model) -> set[int]:
    """ids of the layers that consume a float input of a Functional model."""
    if not is_graph(model) or isinstance(model, keras.Sequential):
        return set()
    consumers = _graph_consumers(model)
    readers: set[int] = set()
    for tensor in keras.tree.flatten(model.inputs):
        if keras.backend.is_float_dtype(tensor.dtype):
            for op in consumers.get(id(keras_private.producer(tensor)), []):
                if op is not None:
                    readers.add(id(op))
    return readers


def float_input_paths(model: keras.layers.Layer) -> list[tuple[str, list]]:
    """For each float `keras.Input` of a Functional model, the layers its
    values reach through the graph (through layers and ops), in order, each
    with whether the values were cast to the layer's compute dtype on the
    way (rounded to 16-bit by a layer before it):
    `[(input name, [(layer, rounded_before_it)])]`."""
    if not is_graph(model) or isinstance(model, keras.Sequential):
        return []
    consumers = _graph_consumers(model)
    result = []
    for tensor in keras.tree.flatten(model.inputs):
        if not keras.backend.is_float_dtype(tensor.dtype):
            continue
        reached = []
        stack = [
            (op, False) for op in consumers.get(id(keras_private.producer(tensor)), [])
        ]
        seen: set[int] = set()
        while stack:
            operation, cast = stack.pop()
            if operation is None or id(operation) in seen:
                continue
            seen.add(id(operation))
            if isinstance(operation, keras.layers.Layer):
                reached.append((operation, cast))
                # Past a 16-bit layer the values are 16-bit (an Embedding
                # turns ids into vectors: nothing to round after it).
                rounds = operation.compute_dtype in SIXTEEN_BIT
                if isinstance(operation, keras.layers.Embedding):
                    continue
                stack.extend(
                    (op, cast or rounds) for op in consumers.get(id(operation), [])
                )
            elif type(operation).__name__ in PASS_THROUGH_OPS:
                stack.extend((op, cast) for op in consumers.get(id(operation), []))
        result.append((tensor.name, reached))
    return result
