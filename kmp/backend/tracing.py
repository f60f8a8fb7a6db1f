"""What a model's layers really compute in: one traced forward pass, its
TensorFlow ops attributed to the layers that ran them.

A layer's policy says what Keras casts its inputs and variables to; what its
`call` then does is its own code: Keras's normalization layers compute
their statistics in float32, a KerasHub attention computes query x key in
bfloat16 and its softmax in float32, a user's attention layer may do its
softmax in float16. `trace(model)` traces `model(x, training=False)` with
`tf.function` (nothing runs) and reads each op's dtype. Ops are attributed
to layers through the name scopes Keras opens around every layer call
(`model/block/attention/query/MatMul`). Keras's `Layer.__call__` enters a
layer's scope twice per call (around its build step, which runs even when
the layer is built, and around `call`), so the scope the ops land in is the
layer's name plus one numeric suffix that TensorFlow adds to keep names
unique (`dense` -> `dense_1`, a layer named `dense_1` -> `dense_1_2`):
stripping one suffix gives the name back.

On Keras's JAX backend, `trace` reads the same from a jaxpr instead
(`kmp.backend.jax.trace`: JAX names each equation with the layers' scopes
too); `forward`, and the choices of `kmp.prepare` it serves, read
TensorFlow's graph alone.

`kmp.precision_report` and `kmp.debug.precision_audit` trace whole models.
`kmp.prepare` reads at most one trace of the model (`forward`), at the
layers' own policies, for the choices only a trace shows: which layers
produce a subclassed model's outputs, what code meets them, whether an
attention layer hands out its scores, and whether a layer hands its token
ids only to its sublayers. Tracing runs nothing and changes nothing.
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import re
import sys
import sysconfig
from typing import Any

import keras

from kmp.internals import keras_private
from kmp.precision import policy as policy_lib
from kmp.precision import traversal

# Ops that move or reshape data, or compute on indices and masks: everything
# else with a float output is math the layer computes in that dtype.
_DATA = frozenset(
    [
        "Cast",
        "Identity",
        "IdentityN",
        "Reshape",
        "Shape",
        "ShapeN",
        "Const",
        "Placeholder",
        "ReadVariableOp",
        "VarHandleOp",
        "StridedSlice",
        "Slice",
        "Transpose",
        "ExpandDims",
        "Squeeze",
        "Pack",
        "Unpack",
        "ConcatV2",
        "GatherV2",
        "ResourceGather",
        "GatherNd",
        "Fill",
        "ZerosLike",
        "OnesLike",
        "StopGradient",
        "NoOp",
        "Range",
        "Tile",
        "BroadcastTo",
        "Select",
        "SelectV2",
        "Split",
        "SplitV",
        "Size",
        "Rank",
        "Where",
        "PlaceholderWithDefault",
        "TensorScatterUpdate",
        "XlaDynamicUpdateSlice",
        "Roll",
        "ReverseV2",
        "Pad",
        "PadV2",
        "MirrorPad",
    ]
)
DATA_OPS = _DATA
_MATMUL = frozenset(
    ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")
)
_SOFTMAX = frozenset(("Softmax", "LogSoftmax"))
# Between the query x key product and the softmax: scaling, masking, bias,
# soft-capping, reshaping.
_TO_SOFTMAX = frozenset(
    [
        "Mul",
        "RealDiv",
        "AddV2",
        "Add",
        "Sub",
        "Cast",
        "SelectV2",
        "Select",
        "Tanh",
        "Maximum",
        "Minimum",
        "Identity",
        "Reshape",
        "Transpose",
        "Neg",
    ]
)
_FLOATS = ("float16", "bfloat16", "float32", "float64")
_SUFFIX = re.compile(r"_\d+$")


@dataclasses.dataclass(frozen=True)
class LayerOps:
    """What one layer's call did in the traced forward pass.

    Attributes:
        path: The layer's path.
        computes: Float dtypes of its own math ops (casts and data movement
            left out), its sublayers' not included.
        returns: Float dtypes of what it hands out (tensors its ops produce
            that ops outside it consume).
        float32_ops: Types of the float32 math ops in it and its sublayers
            (e.g. `('Mean', 'Rsqrt')`), when it computes in a 16-bit dtype.
        softmax: Dtypes of its own softmax ops.
        scores: Dtypes of its own matrix products whose result reaches a
            softmax: attention scores.
        matmuls: How many matrix products (matmuls, einsums) its own code
            ran (a layer called twice runs its product twice).
    """

    path: str
    computes: tuple[str, ...] = ()
    returns: tuple[str, ...] = ()
    float32_ops: tuple[str, ...] = ()
    softmax: tuple[str, ...] = ()
    scores: tuple[str, ...] = ()
    matmuls: int = 0


@dataclasses.dataclass(frozen=True)
class Trace:
    """The result of `trace`.

    Attributes:
        layers: `LayerOps` per layer path (the layers that ran).
        outputs: Float dtypes of the model's outputs.
        error: Why the model could not be traced, or None.
        error_at: Where in user code the trace failed
            (`'file.py:12: return x * noise'`), or `''`.
    """

    layers: dict[str, LayerOps]
    outputs: tuple[str, ...] = ()
    error: str | None = None
    error_at: str = ""

    def of(self, path: str) -> LayerOps | None:
        return self.layers.get(path)


def _input_specs(model):
    """KerasTensors of the model's inputs (batch dimension None), or None."""
    if isinstance(model, keras.Sequential):
        try:
            structure = model.inputs[0] if model.inputs else None
        except (AttributeError, ValueError):  # not built
            return None
    elif traversal.is_graph(model):
        try:
            structure = model.input
        except (AttributeError, ValueError):
            return None
    else:
        # A subclassed model built by a call: the shapes Keras recorded.
        shapes = keras_private.build_shapes(model)
        if len(shapes) != 1:
            return None
        structure = keras.tree.map_shape_structure(
            lambda shape: keras.KerasTensor((None, *shape[1:]), "float32"),
            next(iter(shapes.values())),
        )
    return structure


def _no_shapes(model) -> str:
    return (
        f"{type(model).__name__} has no input shapes kmp can read (not built, "
        "or a subclassed model called with several arguments)"
    )


def traceable(model: keras.layers.Layer) -> bool:
    """Whether kmp can read input shapes to trace `model` with (`trace`)."""
    return _input_specs(model) is not None


def trace(model: keras.layers.Layer) -> Trace:
    """Traces `model(x, training=False)` for its input shapes and
    attributes every op to the layer that ran it.

    Args:
        model: A built model: a Functional or Sequential one with inputs, or
            a subclassed one built by a call on one argument, a tensor or
            a tuple of them (traced with float32 inputs of the shapes it was
            built with).

    Returns:
        A `Trace`; its `error` says why when the model cannot be traced
        (an unbuilt model, a subclassed one called with several
        arguments).

    Example:

    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> model = keras.Sequential([keras.Input((8,)),
    ...                           keras.layers.LayerNormalization(name="norm")])
    >>> ops = kmp.backend.tracing.trace(model).of("norm")
    >>> ops.returns, "Rsqrt" in ops.float32_ops
    (('bfloat16',), True)
    """
    specs = _input_specs(model)
    if specs is None:
        return Trace({}, error=f"{_no_shapes(model)}: nothing to trace")
    if keras.backend.backend() == "jax":
        from kmp.backend.jax import trace as jax_trace

        try:
            layers, outputs = jax_trace.layer_ops(model, specs)
        except Exception as e:  # any failure of user code: the trace is advisory
            return Trace({}, error=error_line(e), error_at=user_line(e))
        return Trace({p: LayerOps(p, **ops) for p, ops in layers.items()}, outputs)
    concrete, error, where = _concrete(model, specs)
    if error:
        return Trace({}, error=error, error_at=where)
    import tensorflow as tf

    graph = concrete.graph
    paths = {id(site.layer): site.path for site in traversal.walk(model)}
    names: dict[int, dict] = {}  # id(layer) -> {child name: child}
    chains = {op.name: _chain(model, op.name, names) for op in graph.get_operations()}

    def dtype(tensor) -> str | None:
        name = tensor.dtype.name
        return name if name in _FLOATS else None

    own: dict[int, list] = {}
    inside: dict[int, list] = {}
    layer_of: dict[int, keras.layers.Layer] = {}
    for op in graph.get_operations():
        chain = chains[op.name]
        for layer in chain:
            layer_of[id(layer)] = layer
            inside.setdefault(id(layer), []).append(op)
        if chain:
            own.setdefault(id(chain[-1]), []).append(op)
    outputs = {
        t.ref()
        for t in keras.tree.flatten(concrete.outputs)
        if isinstance(t, tf.Tensor)
    }
    result: dict[str, LayerOps] = {}
    for key, ops in inside.items():
        layer = layer_of[key]
        path = paths.get(key)
        if path is None:
            continue
        names = {op.name for op in ops}
        computes = sorted(
            {
                d
                for op in own.get(key, [])
                if op.type not in _DATA
                for d in map(dtype, op.outputs)
                if d
            }
        )
        returns = sorted(
            {
                d
                for op in ops
                for t in op.outputs
                if (d := dtype(t))
                and (
                    t.ref() in outputs
                    or any(c.name not in names for c in t.consumers())
                )
            }
        )
        sixteen = layer.compute_dtype in policy_lib.SIXTEEN_BIT
        float32_ops = sorted(
            {
                op.type
                for op in ops
                if op.type not in _DATA
                and any(dtype(t) == "float32" for t in op.outputs)
            }
            if sixteen
            else set()
        )
        softmax = sorted(
            {
                dtype(op.outputs[0])
                for op in own.get(key, [])
                if op.type in _SOFTMAX and dtype(op.outputs[0])
            }
        )
        scores = sorted(
            {
                dtype(op.outputs[0])
                for op in own.get(key, [])
                if op.type in _MATMUL and dtype(op.outputs[0]) and _reaches_softmax(op)
            }
        )
        result[path] = LayerOps(
            path,
            tuple(computes),
            tuple(returns),
            tuple(float32_ops),
            tuple(softmax),
            tuple(scores),
            sum(op.type in _MATMUL for op in own.get(key, [])),
        )
    outs = tuple(
        d
        for t in keras.tree.flatten(concrete.outputs)
        if isinstance(t, tf.Tensor) and (d := dtype(t))
    )
    return Trace(result, outs)


NOT_ON_THIS_BACKEND = (
    "kmp reads the ops a model runs from TensorFlow's traced graph, and "
    "Keras runs its {} backend here"
)


def _concrete(model, specs):
    """(the concrete function of `model(x, training=False)`, None, ''), or
    (None, why it could not be traced, where in user code)."""
    if keras.backend.backend() != "tensorflow":
        return None, NOT_ON_THIS_BACKEND.format(keras.backend.backend()), ""
    import tensorflow as tf

    specs = keras.tree.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), specs)
    try:
        function = tf.function(lambda x: model(x, training=False))
        return function.get_concrete_function(specs), None, ""
    except Exception as e:  # any failure of user code: the trace is advisory
        return None, error_line(e), user_line(e)


def _libraries() -> tuple[str, ...]:
    """The directories of code that is not the user's: Keras, kmp,
    TensorFlow where it was imported (no frame of it otherwise), Python's
    own library."""
    packages = [keras, sys.modules[__name__.split(".")[0]]]
    if "tensorflow" in sys.modules:
        packages.append(sys.modules["tensorflow"])
    return (
        *(os.path.dirname(os.path.abspath(p.__file__)) + os.sep for p in packages),
        sysconfig.get_paths()["stdlib"] + os.sep,
    )


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def user_line(error: BaseException) -> str:
    """Where in user code an error was raised
    (`'vae.py:40 in Sampling.call: return z * e'`): the innermost frame
    outside installed packages (Keras, TensorFlow, KerasHub, kmp) and
    Python's own library, from the traceback or from the frames a
    tf.function error names; `''` when there is none."""
    frames = [(m[1], int(m[2]), "") for m in _FRAME.finditer(str(error))]
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        owner = tb.tb_frame.f_locals.get("self")
        name = f"{type(owner).__name__}.{code.co_name}" if owner is not None else ""
        frames.append((code.co_filename, tb.tb_lineno, name))
        tb = tb.tb_next
    libraries = _libraries()
    for filename, line, name in reversed(frames):
        path = os.path.abspath(filename)
        if (
            path.startswith(libraries)
            or "__autograph_generated" in path
            or f"{os.sep}site-packages{os.sep}" in path
            or f"{os.sep}dist-packages{os.sep}" in path
        ):
            continue
        text = linecache.getline(path, line).strip()
        where = f"{os.path.basename(path)}:{line}" + (f" in {name}" if name else "")
        return f"{where}: {text}" if text else ""
    return ""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Lines of Keras's wrapping of an error raised in a layer's call.
_WRAPPING = ("Exception encountered", "Arguments received", "\u2022")


# How TensorFlow says that a raw op met mixed float dtypes.
_MIXED = ("does not match type", "was expected to be a", "that don't all match")


def dtype_errors() -> tuple[type[Exception], ...]:
    """What a call or a trace that mixes float dtypes raises: a `TypeError`,
    and on TensorFlow its `InvalidArgumentError` too."""
    if keras.backend.backend() != "tensorflow":
        return (TypeError,)
    import tensorflow as tf

    return (TypeError, tf.errors.InvalidArgumentError)


def mixes_dtypes(error: BaseException | str) -> bool:
    """Whether an error is TensorFlow refusing mixed dtypes in an op."""
    return any(text in str(error) for text in _MIXED)


def error_line(error: BaseException) -> str:
    """The line of an exception that says what went wrong (Keras wraps an
    error raised in `call` between lines naming the layer and its
    arguments), at most 200 characters."""
    lines = [_ANSI.sub("", line).strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line and not line.startswith(_WRAPPING)]
    return (lines[-1] if lines else type(error).__name__)[:200]


@dataclasses.dataclass(frozen=True)
class OutputSources:
    """The result of `output_sources`.

    Attributes:
        layers: ids of the direct sublayers of the model whose call
            produces one of its float outputs (through data movement only:
            reshapes, slices, identities; not through a cast or math in the
            model's own code).
        ran: ids of the direct sublayers that ran in the trace (a model a
            `train_step` calls but `call` does not is not among them).
        error: Why the model could not be traced, or None.
    """

    layers: frozenset[int] = frozenset()
    ran: frozenset[int] = frozenset()
    error: str | None = None


# Ops in a model's own code that hand a sublayer's output on unchanged in
# dtype: an output they produce comes from that sublayer.
_HANDS_ON = _DATA - {"Cast", "Const", "Placeholder", "ReadVariableOp"}


@dataclasses.dataclass(frozen=True)
class Forward:
    """One read-only trace of `model(x, training=False)` at the layers' own
    policies: the graph the planner reads every choice it needs a trace for
    from.

    Attributes:
        graph: The traced graph, or None. On JAX, a
            `kmp.backend.jax.flow.Flow`, which answers the questions below
            itself.
        outputs: The model's float output tensors in it.
        chains: Per op name, the layers whose calls the op ran in,
            outermost first (`owners`), read once for every choice.
        error: Why the model could not be traced, or None.
    """

    graph: Any = None
    outputs: tuple = ()
    chains: dict = dataclasses.field(default_factory=dict)
    error: str | None = None


def forward(model: keras.layers.Layer) -> Forward:
    """Traces `model(x, training=False)` once for its input shapes; nothing
    runs and nothing changes.

    Args:
        model: A built model (see `trace` for what can be traced).

    Returns:
        A `Forward`; its `error` says why when the model cannot be traced.
    """
    specs = _input_specs(model)
    if specs is None:
        return Forward(error=_no_shapes(model))
    if keras.backend.backend() == "jax":
        from kmp.backend.jax import flow
        from kmp.backend.jax import trace as jax_trace

        try:
            closed = jax_trace.jaxpr_of(model, specs)
        except Exception as e:  # any failure of user code: choices fall back
            return Forward(error=error_line(e))
        return Forward(graph=flow.Flow(model, closed))
    concrete, error, _ = _concrete(model, specs)
    if error:
        return Forward(error=error)
    import tensorflow as tf

    outputs = tuple(
        t
        for t in keras.tree.flatten(concrete.outputs)
        if isinstance(t, tf.Tensor) and t.dtype.name in _FLOATS
    )
    op_names = [op.name for op in concrete.graph.get_operations()]
    return Forward(concrete.graph, outputs, owners(model, op_names))


def _leaving(ops, inside: set[str]) -> list:
    """The float tensors `ops` produce that ops outside `inside` (op names)
    consume."""
    return [
        t
        for op in ops
        for t in op.outputs
        if t.dtype.name in _FLOATS and any(c.name not in inside for c in t.consumers())
    ]


def float32_output_mixes(
    model: keras.layers.Layer, traced: Forward, layer: keras.layers.Layer
) -> str | None:
    """Where `layer`'s output, were it in another dtype (float32, or
    bfloat16 in a float16 model), would meet a 16-bit tensor in code outside
    it (the model's own code, or a layer's that does not cast its inputs),
    read from `traced`: the op, as `'Sub in Net'`. None where it would meet
    none: it reaches only casts, Keras layers (which cast their inputs),
    Python numbers and the model's outputs. A 16-bit constant kmp cannot
    tell from one made in a fixed dtype counts as a 16-bit tensor."""
    if keras.backend.backend() == "jax":
        return traced.graph.float32_output_mixes(layer)
    ops = traced.graph.get_operations()
    chains = traced.chains
    inside = {name for name, chain in chains.items() if layer in chain}
    own = [op for op in ops if op.name in inside]
    if not own:
        return None
    enclosing = chains[own[0].name][: chains[own[0].name].index(layer)]

    def absorbs(op) -> bool:
        """A cast makes its own dtype; a Keras layer casts its inputs."""
        if op.type == "Cast":
            return True
        chain = chains[op.name]
        shared = 0
        while (
            shared < min(len(chain), len(enclosing))
            and chain[shared] is enclosing[shared]
        ):
            shared += 1
        return shared < len(chain) and keras_private.converts_input_args(chain[shared])

    # First everything the output reaches (the graph's ops come in
    # topological order), then what else each op that takes it meets.
    reached = {t.ref() for t in _leaving(own, inside)}
    takers = []
    for op in ops:
        if op.name in inside or not any(t.ref() in reached for t in op.inputs):
            continue
        if absorbs(op):
            continue
        takers.append(op)
        reached.update(t.ref() for t in op.outputs if t.dtype.name in _FLOATS)
    for op in takers:
        for t in op.inputs:
            if t.ref() in reached or t.dtype.name not in policy_lib.SIXTEEN_BIT:
                continue
            if _python_number(t, op):
                continue
            chain = chains[op.name]
            return f"{op.type} in {type(chain[-1] if chain else model).__name__}"
    return None


def _python_number(tensor, consumer) -> bool:
    """Whether `tensor` is a constant TensorFlow made from a Python number
    for `consumer` (named under it, as `mul/y`): in another trace it is made
    in the other operand's dtype."""
    op = source(tensor).op
    return op.type == "Const" and op.name.startswith(consumer.name + "/")


def source(tensor, casts: bool = False):
    """The tensor that `tensor` is an identity of (and, with `casts`, a cast
    of), followed back: an `IdentityN`'s k-th output is its k-th input."""
    through = ("Identity", "IdentityN", "Cast") if casts else ("Identity", "IdentityN")
    while tensor.op.type in through and tensor.op.inputs:
        index = tensor.value_index if tensor.op.type == "IdentityN" else 0
        tensor = tensor.op.inputs[index]
    return tensor


def hands_out(
    traced: Forward, layer: keras.layers.Layer, part: keras.layers.Layer
) -> bool:
    """Whether what `part` (a sublayer of `layer`) computes leaves `layer`
    unchanged (through reshapes, slices and identities, not math): an
    attention layer that returns its softmax's scores. Read from
    `traced`."""
    if keras.backend.backend() == "jax":
        return traced.graph.hands_out(layer, part)
    chains = traced.chains
    outer = {name for name, chain in chains.items() if layer in chain}
    own = {name for name, chain in chains.items() if part in chain}
    outputs = {t.ref() for t in traced.outputs}
    ops = [op for op in traced.graph.get_operations() if op.name in own]
    stack = _leaving(ops, own)
    seen: set[str] = set()
    while stack:
        t = stack.pop()
        if t.ref() in outputs:
            return True
        for c in t.consumers():
            if c.name not in outer:
                return True
            if c.name not in seen and c.type in _HANDS_ON:
                seen.add(c.name)
                stack.extend(x for x in c.outputs if x.dtype.name in _FLOATS)
    return False


def input_only_feeds_sublayers(traced: Forward, layer: keras.layers.Layer) -> bool:
    """Whether `layer`'s own code hands its inputs only to its sublayers
    (through reshapes, slices and casts, not math), read from `traced`: then
    what it returns does not depend on the dtype its inputs arrive in. False
    where it did not run in the trace."""
    if keras.backend.backend() == "jax":
        return traced.graph.input_only_feeds_sublayers(layer)
    ops = traced.graph.get_operations()
    chains = traced.chains
    inside = {name for name, chain in chains.items() if layer in chain}
    if not inside:
        return False
    depth = chains[next(iter(inside))].index(layer) + 1
    stack = [
        (op, t)
        for op in ops
        if op.name in inside
        for t in op.inputs
        if t.dtype.name in _FLOATS and t.op.name not in inside
    ]
    seen: set[str] = set()
    while stack:
        op, _ = stack.pop()
        if op.name in seen or op.name not in inside:
            continue
        seen.add(op.name)
        if len(chains[op.name]) > depth or op.type == "Cast":
            continue  # a sublayer's code, or a cast: the dtype stops here
        if op.type not in _HANDS_ON:
            return False  # its own math on what it was given
        stack.extend(
            (c, t) for t in op.outputs if t.dtype.name in _FLOATS for c in t.consumers()
        )
    return True


def output_sources(
    model: keras.layers.Layer, traced: Forward | None = None
) -> OutputSources:
    """Which of a model's direct sublayers produce its outputs, read from
    one trace of `model(x, training=False)` (for a subclassed model, whose
    `call` is code kmp cannot read otherwise).

    Args:
        model: A built model (see `trace` for what can be traced).
        traced: Its `forward` trace, where the caller has one.

    Returns:
        An `OutputSources`.

    Example:

    >>> class Net(keras.Model):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.hidden = keras.layers.Dense(8)
    ...         self.head = keras.layers.Dense(2)
    ...     def call(self, x):
    ...         return self.head(self.hidden(x))
    >>> net = Net()
    >>> _ = net(np.ones((1, 4)))
    >>> kmp.backend.tracing.output_sources(net).layers == {id(net.head)}
    True
    """
    traced = traced or forward(model)
    if traced.error:
        return OutputSources(error=traced.error)
    if keras.backend.backend() == "jax":
        return OutputSources(*traced.graph.output_sources())
    found: set[int] = set()
    seen: set[str] = set()
    ran = {id(chain[0]) for chain in traced.chains.values() if chain}
    stack = [t.op for t in traced.outputs]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        chain = traced.chains[op.name]
        if chain:
            found.add(id(chain[0]))
        elif op.type in _HANDS_ON:
            stack.extend(t.op for t in op.inputs if t.dtype.name in _FLOATS)
    return OutputSources(frozenset(found), frozenset(ran))


def owners(model: keras.layers.Layer, op_names) -> dict[str, list]:
    """The layers whose calls each op (by name) ran in, outermost first (the
    model itself left out: an op of the model's own code has none)."""
    names: dict[int, dict] = {}
    return {name: _chain(model, name, names) for name in op_names}


def reaches_softmax(op) -> bool:
    """Whether an op's output flows into a softmax through scaling, masking
    and reshaping ops only (attention scores and the masks added to them)."""
    return op.type in _SOFTMAX or _reaches_softmax(op)


def _chain(model, op_name: str, names: dict) -> list:
    """The layers whose calls an op ran in, outermost first (the model
    itself left out). `names` caches each layer's children by name."""
    parts = op_name.split("/")[:-1]
    if not parts or _SUFFIX.sub("", parts[0]) != model.name:
        return []
    chain = []
    current = model
    for part in parts[1:]:
        by_name = names.get(id(current))
        if by_name is None:
            by_name = {c.name: c for c in traversal.children(current)}
            names[id(current)] = by_name
        child = by_name.get(_SUFFIX.sub("", part))
        if child is None:
            child = by_name.get(part)
        if child is None:
            break
        chain.append(child)
        current = child
    return chain


def _reaches_softmax(op, depth: int = 8) -> bool:
    """Whether an op's output flows into a softmax through scaling, masking
    and reshaping ops only."""
    frontier = [op]
    for _ in range(depth):
        following = []
        for node in frontier:
            for t in node.outputs:
                for consumer in t.consumers():
                    if consumer.type in _SOFTMAX:
                        return True
                    if consumer.type in _TO_SOFTMAX:
                        following.append(consumer)
        if not following:
            return False
        frontier = following
    return False


def recorded_input(layer: keras.layers.Layer) -> keras.KerasTensor | None:
    """The one symbolic input a layer was called on in a functional graph,
    or None (never called there, called on several, or not on a tensor)."""
    try:
        spec = layer.input
    except (AttributeError, ValueError):
        return None
    return spec if isinstance(spec, keras.KerasTensor) else None
