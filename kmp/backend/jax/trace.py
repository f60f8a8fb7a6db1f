"""What a model's layers compute on JAX: one jaxpr of `model(x,
training=False)`, its equations attributed to the layers that ran them
(`kmp.backend.tracing.trace` makes its `Trace` of them).

JAX records, with each equation it traces, the name scopes open at the time
(`source_info.name_stack`). Keras opens one per layer call, named after the
layer (`mha/query`), so the scopes name the layers as TensorFlow's op names
do (`kmp.backend.tracing`). The jaxpr is made from abstract values (shapes
and dtypes): nothing runs.

The model is called as `model(x, training=False)` with its variables'
values abstract (in a `keras.StatelessScope`), every unknown dimension at
2. JAX has no softmax primitive: a softmax is read as what
`jax.nn.softmax` computes, an `exp` divided by its own `reduce_sum` (and a
log-softmax as the log of that sum subtracted). A product is read as
attention scores where neither of its operands is computed from weights
alone, and its result flows into a softmax within the same jaxpr.
"""

from __future__ import annotations

from typing import Any

import keras

from kmp.precision import policy as policy_lib
from kmp.precision import traversal

# Primitives that hand a value on unchanged in dtype: reshapes, slices,
# copies, selections, and writes of one value into another.
MOVES = frozenset(
    [
        "reshape",
        "broadcast_in_dim",
        "transpose",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "gather",
        "scatter",
        "concatenate",
        "pad",
        "select_n",
        "copy",
        "rev",
        "split",
        "stop_gradient",
        "device_put",
        "sharding_constraint",
    ]
)
# Calls of a jitted function, a custom derivative or a rematerialized one.
CALLS = frozenset(
    [
        "pjit",
        "jit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "remat",
        "remat2",
        "checkpoint",
    ]
)
# Primitives that move, reshape or select data, or compute on indices and
# masks: everything else with a float output is math.
_DATA = (
    MOVES
    | CALLS
    | frozenset(
        [
            "convert_element_type",
            "iota",
            "cond",
            "while",
            "scan",
            "shard_map",
        ]
    )
)
_MATMUL = frozenset(["dot_general"])
# Between the query x key product and the softmax: scaling, masking, bias,
# soft-capping, reshaping, and the softmax's own subtraction of its maximum.
_TO_SOFTMAX = frozenset(
    [
        "mul",
        "div",
        "add",
        "sub",
        "neg",
        "max",
        "min",
        "tanh",
        "convert_element_type",
        "select_n",
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "reduce_max",
        "stop_gradient",
    ]
)
_SUBJAXPRS = ("jaxpr", "call_jaxpr", "fun_jaxpr", "body_jaxpr", "cond_jaxpr")


def layer_ops(
    model: keras.layers.Layer, specs: Any
) -> tuple[dict[str, dict[str, Any]], tuple[str, ...]]:
    """Traces `model(x, training=False)` for `specs` (KerasTensors; every
    unknown dimension traced at 2) into a jaxpr and attributes its
    equations to layers.

    Returns:
        Per layer path, the fields of its `kmp.backend.tracing.LayerOps`
        (JAX's primitive names in `float32_ops`); and the float dtypes of
        the model's outputs.

    Raises:
        Whatever the model's code raises while it is traced.
    """
    closed = jaxpr_of(model, specs)
    weights = len(model.trainable_variables) + len(model.non_trainable_variables)
    return _read(model, closed.jaxpr, set(closed.jaxpr.invars[:weights]))


def jaxpr_of(model: keras.layers.Layer, specs: Any) -> Any:
    """The closed jaxpr of `model(x, training=False)` for `specs`, made from
    abstract values: its first inputs are the trainable, then the
    non-trainable variables' values; nothing runs."""
    import jax

    def abstract(t):
        shape = tuple(2 if d is None else d for d in t.shape)
        return jax.ShapeDtypeStruct(shape, t.dtype)

    def values(variables):
        return [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in variables]

    def forward(trainable, non_trainable, x):
        # The model's own call (its input casts and autocast scope too), on
        # abstract values of its variables.
        mapping = [
            *zip(model.trainable_variables, trainable, strict=True),
            *zip(model.non_trainable_variables, non_trainable, strict=True),
        ]
        with keras.StatelessScope(state_mapping=mapping):
            return model(x, training=False)

    return jax.make_jaxpr(forward)(
        values(model.trainable_variables),
        values(model.non_trainable_variables),
        keras.tree.map_structure(abstract, specs),
    )


def _read(
    model: keras.layers.Layer, jaxpr: Any, weights: set
) -> tuple[dict[str, dict[str, Any]], tuple[str, ...]]:
    """`layer_ops` of a model's jaxpr, whose inputs `weights` are the
    variables' values."""
    paths = {id(site.layer): site.path for site in traversal.walk(model)}
    chains = Chains(model)
    own: dict[str, list] = {}  # path -> its own equations (any depth)
    inside: dict[str, list] = {}  # path -> its and its sublayers' equations
    # (id(the equation that ends a softmax), the path of the layer that ran it):
    # a jitted function's equations are shared by every call of it.
    softmax_ends: set[tuple[int, str]] = set()
    scores: dict[str, list[str]] = {}
    returns: dict[str, set[str]] = {}

    def visit(jaxpr: Any, prefix: str, weights: set, top: bool) -> None:
        consumers: dict[Any, list] = {}
        for eqn in jaxpr.eqns:
            for var in eqn.invars:
                if not is_literal(var):
                    consumers.setdefault(var, []).append(eqn)
        # The model's outputs; a nested jaxpr's outputs go back to its caller.
        outvars = {v for v in jaxpr.outvars if not is_literal(v)} if top else set()
        weights = _computed_from(weights, jaxpr)
        names = {id(eqn): name_of(prefix, eqn) for eqn in jaxpr.eqns}
        layer_paths = {
            id(eqn): [paths[id(layer)] for layer in chains.of(names[id(eqn)])]
            for eqn in jaxpr.eqns
        }
        softmaxes = _softmaxes(jaxpr, consumers)
        for eqn in jaxpr.eqns:
            chain = layer_paths[id(eqn)]
            for path in chain:
                inside.setdefault(path, []).append(eqn)
            if chain:
                own.setdefault(chain[-1], []).append(eqn)
                if id(eqn) in softmaxes:
                    softmax_ends.add((id(softmaxes[id(eqn)]), chain[-1]))
                if _scores(eqn, weights, consumers, softmaxes):
                    dtype = float_dtype(eqn.outvars[0])
                    if dtype:
                        scores.setdefault(chain[-1], []).append(dtype)
            # What a layer hands out: its outputs that an equation outside it,
            # or the jaxpr's own outputs, take.
            for var in eqn.outvars:
                dtype = float_dtype(var)
                if not dtype:
                    continue
                outside = [layer_paths[id(c)] for c in consumers.get(var, [])]
                for path in chain:
                    if var in outvars or any(path not in c for c in outside):
                        returns.setdefault(path, set()).add(dtype)
            for sub, operands in subjaxprs(eqn):
                inner = {
                    i
                    for i, o in zip(sub.invars, operands, strict=False)
                    if not is_literal(o) and o in weights
                }
                visit(sub, names[id(eqn)], inner, top=False)

    visit(jaxpr, "", weights, top=True)
    result = {}
    for layer_id, path in paths.items():
        if path not in inside:
            continue
        layer = chains.layers[layer_id]
        mine = own.get(path, [])
        math = [e for e in mine if e.primitive.name not in _DATA]
        sixteen = layer.compute_dtype in policy_lib.SIXTEEN_BIT
        result[path] = dict(
            computes=_dtypes(math),
            returns=tuple(sorted(returns.get(path, ()))),
            float32_ops=tuple(
                sorted(
                    {
                        e.primitive.name
                        for e in inside[path]
                        if e.primitive.name not in _DATA
                        and any(float_dtype(v) == "float32" for v in e.outvars)
                    }
                )
            )
            if sixteen
            else (),
            softmax=tuple(
                sorted(
                    {
                        float_dtype(e.outvars[0])
                        for e in mine
                        if (id(e), path) in softmax_ends and float_dtype(e.outvars[0])
                    }
                )
            ),
            scores=tuple(sorted(set(scores.get(path, ())))),
            matmuls=sum(e.primitive.name in _MATMUL for e in mine),
        )
    outputs = tuple(d for var in jaxpr.outvars if (d := float_dtype(var)))
    return result, outputs


class Chains:
    """The layers a name stack (`block/attention/query/...`) names, outermost
    first, read from the model's children by name."""

    def __init__(self, model: keras.layers.Layer):
        self.model = model
        self.layers = {id(site.layer): site.layer for site in traversal.walk(model)}
        self._children: dict[int, dict] = {}

    def of(self, name_stack: str) -> list:
        chain = []
        current = self.model
        for part in name_stack.split("/"):
            by_name = self._children.get(id(current))
            if by_name is None:
                by_name = {c.name: c for c in traversal.children(current)}
                self._children[id(current)] = by_name
            child = by_name.get(part)
            if child is None:
                if not chain and part == self.model.name:
                    continue  # the model's own scope, where one is open
                break
            chain.append(child)
            current = child
        return [layer for layer in chain if id(layer) in self.layers]


def name_of(prefix: str, eqn: Any) -> str:
    own = str(eqn.source_info.name_stack)
    return f"{prefix}/{own}" if prefix and own else prefix or own


def subjaxprs(eqn: Any) -> list[tuple[Any, list]]:
    """The jaxprs nested in `eqn`, each with the operands of `eqn` that its
    inputs take (a condition's index and a loop's other constants left
    out)."""
    found = []
    params = eqn.params
    for key, value in params.items():
        if key not in _SUBJAXPRS and key != "branches":
            continue
        operands = list(eqn.invars)
        if key == "branches":
            operands = operands[1:]  # the first is the branch's index
        elif eqn.primitive.name == "while":
            conds, bodies = params["cond_nconsts"], params["body_nconsts"]
            carry = operands[conds + bodies :]
            operands = (
                operands[:conds] + carry
                if key == "cond_jaxpr"
                else operands[conds : conds + bodies] + carry
            )
        for item in value if isinstance(value, (list, tuple)) else [value]:
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                found.append((inner, operands))
    return found


def is_literal(var: Any) -> bool:
    """Whether an equation's input is a constant written into it."""
    from jax.extend import core

    return isinstance(var, core.Literal)


def float_dtype(var: Any) -> str:
    """The float dtype of a jaxpr value, by name; "" for any other (an
    integer, a bool, a random key such as a `SeedGenerator`'s state)."""
    name = getattr(getattr(getattr(var, "aval", None), "dtype", None), "name", "")
    return name if name in ("float16", "bfloat16", "float32", "float64") else ""


def _dtypes(eqns: list) -> tuple[str, ...]:
    return tuple(sorted({d for e in eqns for v in e.outvars if (d := float_dtype(v))}))


def _softmaxes(jaxpr: Any, consumers: dict) -> dict[int, Any]:
    """The softmaxes of one jaxpr: id(exp equation) -> the `div` that
    normalizes it by its own `reduce_sum` (reshapes and broadcasts between
    them allowed), or for a log-softmax the `sub` of that sum's `log`."""
    found = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "exp":
            continue
        exp_out = eqn.outvars[0]
        sums = _forward(exp_out, consumers, {"reduce_sum"})
        totals = {v for s in sums for v in _following(s.outvars[0], consumers)}
        for div in _forward(exp_out, consumers, {"div"}):
            divisor = div.invars[1] if len(div.invars) == 2 else None
            if divisor is not None and not is_literal(divisor) and divisor in totals:
                found[id(eqn)] = div
                break
        else:
            # log_softmax: x - max - log(sum(exp(x - max))).
            for log in (c for t in totals for c in consumers.get(t, [])):
                if log.primitive.name != "log":
                    continue
                subs = _forward(log.outvars[0], consumers, {"sub"})
                if subs:
                    found[id(eqn)] = subs[0]
                    break
    return found


_SHAPE = frozenset(["reshape", "broadcast_in_dim", "convert_element_type"])


def _following(var: Any, consumers: dict) -> set:
    """`var` and what reshapes, broadcasts and casts make of it."""
    seen = {var}
    frontier = [var]
    while frontier:
        v = frontier.pop()
        for c in consumers.get(v, []):
            if c.primitive.name in _SHAPE:
                for out in c.outvars:
                    if out not in seen:
                        seen.add(out)
                        frontier.append(out)
    return seen


def _forward(var: Any, consumers: dict, wanted: set) -> list:
    """The equations of kind `wanted` that take `var`, directly or through
    reshapes, broadcasts and casts."""
    found = []
    for v in _following(var, consumers):
        found.extend(c for c in consumers.get(v, []) if c.primitive.name in wanted)
    return found


def _computed_from(weights: set, jaxpr: Any) -> set:
    """`weights` and what the jaxpr computes from them alone (and literals):
    a LoRA kernel's sum, a dequantized kernel, a cast or a reshape, and a
    learned query too (attention pooling's: its scores are not read)."""
    found = set(weights)
    for eqn in jaxpr.eqns:  # in order: each equation's inputs come first
        inputs = [v for v in eqn.invars if not is_literal(v)]
        if inputs and all(v in found for v in inputs):
            found.update(eqn.outvars)
    return found


def _scores(eqn: Any, weights: set, consumers: dict, softmaxes: dict) -> bool:
    """Whether `eqn` computes attention scores: a product of two computed
    tensors (neither computed from weights alone: a Dense layer's product
    with its kernel is not one) whose result flows into a softmax."""
    return (
        eqn.primitive.name in _MATMUL
        and not any(not is_literal(v) and v in weights for v in eqn.invars)
        and _reaches(eqn, consumers, softmaxes)
    )


def _reaches(eqn: Any, consumers: dict, softmaxes: dict, depth: int = 10) -> bool:
    """Whether a product's result flows into a softmax's `exp` through
    scaling, masking and reshaping alone."""
    frontier = [eqn]
    for _ in range(depth):
        following = []
        for node in frontier:
            for var in node.outvars:
                for c in consumers.get(var, []):
                    if id(c) in softmaxes:
                        return True
                    if c.primitive.name in _TO_SOFTMAX:
                        following.append(c)
        if not following:
            return False
        frontier = following
    return False
