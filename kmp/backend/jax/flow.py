"""Where a model's values flow on JAX: the planner's questions
(`kmp.backend.tracing.forward` and what reads it), answered from one jaxpr
of `model(x, training=False)` (`kmp.backend.jax.trace.jaxpr_of`).

The jaxpr is flattened: a call of a jitted function (`pjit`, a custom
derivative, `remat`) is replaced by its equations, so a value is followed
across it. Each equation keeps its name stack, which names the layers
whose calls ran it (`kmp.backend.jax.trace`). A condition or loop stays one
equation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from kmp.backend.jax import trace
from kmp.internals import keras_private
from kmp.precision import policy as policy_lib

_CAST = "convert_element_type"


@dataclasses.dataclass(eq=False)
class _Op:
    kind: str  # the primitive's name
    chain: list  # the layers whose calls ran it, outermost first
    inputs: list  # value keys, constants left out
    outputs: list


class Flow:
    """A closed jaxpr of `model(x, training=False)` (`jaxpr_of`), flattened
    into equations (`_Op`s, in order) that take and make values, each value
    a key: `(call, var)`, `call` telling apart the calls of one jitted
    function."""

    def __init__(self, model: keras.layers.Layer, closed: Any):
        self._model = model
        self._chains = trace.Chains(model)
        self._calls = 0
        self._dtypes: dict = {}
        self.ops: list[_Op] = []
        top = self._inline(closed.jaxpr, "", {}, 0)
        # The model's inputs: the jaxpr's inputs after the variables' values.
        weights = len(model.trainable_variables) + len(model.non_trainable_variables)
        self._inputs = {top[v] for v in closed.jaxpr.invars[weights:]}
        self.outputs = {
            top[v]
            for v in closed.jaxpr.outvars
            if not trace.is_literal(v) and trace.float_dtype(v)
        }
        self._producer = {key: op for op in self.ops for key in op.outputs}
        self._consumers: dict = {}
        for op in self.ops:
            for key in op.inputs:
                self._consumers.setdefault(key, []).append(op)

    def _inline(self, jaxpr: Any, prefix: str, keys: dict, call: int) -> dict:
        """Appends `jaxpr`'s equations (calls inlined) and returns the keys of
        its values; `keys` holds those of its inputs."""
        keys = dict(keys)

        def key(var):
            if var not in keys:
                keys[var] = (call, var)
                self._dtypes[keys[var]] = trace.float_dtype(var)
            return keys[var]

        for var in jaxpr.invars:
            key(var)
        for eqn in jaxpr.eqns:
            name = trace.name_of(prefix, eqn)
            inputs = [key(v) for v in eqn.invars if not trace.is_literal(v)]
            inner = trace.subjaxprs(eqn) if eqn.primitive.name in trace.CALLS else []
            if len(inner) == 1:
                sub, operands = inner[0]
                self._calls += 1
                given = {
                    i: key(o)
                    for i, o in zip(sub.invars, operands, strict=False)
                    if not trace.is_literal(o)
                }
                made = self._inline(sub, name, given, self._calls)
                for outer, var in zip(eqn.outvars, sub.outvars, strict=True):
                    if trace.is_literal(var):
                        key(outer)  # a constant: made by nothing here
                    else:
                        keys[outer] = made[var]
                continue
            self.ops.append(
                _Op(
                    eqn.primitive.name,
                    self._chains.of(name),
                    inputs,
                    [key(v) for v in eqn.outvars],
                )
            )
        return keys

    def _float(self, key) -> bool:
        return bool(self._dtypes.get(key))

    def _taking(self, key) -> list:
        return self._consumers.get(key, [])

    def output_sources(self) -> tuple[frozenset[int], frozenset[int]]:
        """ids of the model's direct sublayers that produce its float
        outputs (through moves only, not a cast or math of the model's own
        code), and of those that ran (see `tracing.output_sources`)."""
        ran = {id(op.chain[0]) for op in self.ops if op.chain}
        found: set[int] = set()
        seen: set[int] = set()
        stack = [self._producer[k] for k in self.outputs if k in self._producer]
        while stack:
            op = stack.pop()
            if id(op) in seen:
                continue
            seen.add(id(op))
            if op.chain:
                found.add(id(op.chain[0]))
            elif op.kind in trace.MOVES:
                stack.extend(
                    self._producer[k]
                    for k in op.inputs
                    if self._float(k) and k in self._producer
                )
        return frozenset(found), frozenset(ran)

    def hands_out(self, layer: keras.layers.Layer, part: keras.layers.Layer) -> bool:
        """Whether what `part`, a sublayer of `layer`, computes leaves
        `layer` unchanged, through moves alone (see `tracing.hands_out`)."""
        outer = {id(op) for op in self.ops if any(x is layer for x in op.chain)}
        own = {id(op) for op in self.ops if any(x is part for x in op.chain)}
        stack = [
            k
            for op in self.ops
            if id(op) in own
            for k in op.outputs
            if self._float(k)
            and (k in self.outputs or any(id(c) not in own for c in self._taking(k)))
        ]
        seen: set[int] = set()
        while stack:
            k = stack.pop()
            if k in self.outputs:
                return True
            for c in self._taking(k):
                if id(c) not in outer:
                    return True
                if id(c) not in seen and c.kind in trace.MOVES:
                    seen.add(id(c))
                    stack.extend(x for x in c.outputs if self._float(x))
        return False

    def input_only_feeds_sublayers(self, layer: keras.layers.Layer) -> bool:
        """Whether `layer`'s own code hands its float inputs only to its
        sublayers, through moves and casts (see
        `tracing.input_only_feeds_sublayers`). False where it did not run."""
        inside = [op for op in self.ops if any(x is layer for x in op.chain)]
        if not inside:
            return False
        ids = {id(op) for op in inside}
        depth = [id(x) for x in inside[0].chain].index(id(layer)) + 1

        def given(key) -> bool:
            """A value made outside the layer, or the model's input (not a
            weight's value or a constant)."""
            made_by = self._producer.get(key)
            return key in self._inputs if made_by is None else id(made_by) not in ids

        stack = [
            op for op in inside if any(self._float(k) and given(k) for k in op.inputs)
        ]
        seen: set[int] = set()
        while stack:
            op = stack.pop()
            if id(op) in seen or id(op) not in ids:
                continue
            seen.add(id(op))
            if len(op.chain) > depth or op.kind == _CAST:
                continue  # a sublayer's code, or a cast: the dtype stops here
            if op.kind not in trace.MOVES:
                return False  # its own math on what it was given
            stack.extend(
                c for k in op.outputs if self._float(k) for c in self._taking(k)
            )
        return True

    def float32_output_mixes(self, layer: keras.layers.Layer) -> str | None:
        """Where `layer`'s output, were it in another dtype, would meet a
        16-bit tensor in code outside it (see `tracing.float32_output_mixes`):
        the equation, as `'add in Net'`. None where it reaches only casts,
        Keras layers (which cast their inputs), Python numbers and the
        model's outputs."""
        inside = {id(op) for op in self.ops if any(x is layer for x in op.chain)}
        own = [op for op in self.ops if id(op) in inside]
        if not own:
            return None
        chain = own[0].chain
        enclosing = chain[: [id(x) for x in chain].index(id(layer))]

        def absorbs(op: _Op) -> bool:
            """A cast makes its own dtype; a Keras layer casts its inputs."""
            if op.kind == _CAST:
                return True
            shared = 0
            while (
                shared < min(len(op.chain), len(enclosing))
                and op.chain[shared] is enclosing[shared]
            ):
                shared += 1
            return shared < len(op.chain) and keras_private.converts_input_args(
                op.chain[shared]
            )

        # First everything the output reaches (the equations come in
        # order), then what else each equation that takes it meets.
        reached = {
            k
            for op in own
            for k in op.outputs
            if self._float(k) and any(id(c) not in inside for c in self._taking(k))
        }
        takers = []
        for op in self.ops:
            if id(op) in inside or not any(k in reached for k in op.inputs):
                continue
            if absorbs(op):
                continue
            takers.append(op)
            reached.update(k for k in op.outputs if self._float(k))
        for op in takers:
            for k in op.inputs:
                if k in reached or self._dtypes.get(k) not in policy_lib.SIXTEEN_BIT:
                    continue
                owner = op.chain[-1] if op.chain else self._model
                return f"{op.kind} in {type(owner).__name__}"
        return None
