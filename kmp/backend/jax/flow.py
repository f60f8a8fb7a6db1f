"""Where a model's values flow on JAX: the planner's questions
(`kmp.backend.tracing.forward` and what reads it), answered from one jaxpr
of `model(x, training=False)`.

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

# Calls whose equations are inlined; equations that hand a value on
# unchanged in dtype (reshapes, slices, copies, selections).
_CALLS, _MOVES = trace._CALLS, trace._MOVES
_CAST = "convert_element_type"


@dataclasses.dataclass(eq=False)
class _Op:
    kind: str  # the primitive's name
    chain: list  # the layers whose calls ran it, outermost first
    inputs: list  # value keys, constants left out
    outputs: list


class Forward:
    """One jaxpr of `model(x, training=False)`, flattened into equations
    (`_Op`s) that take and make values, each value a key: `(call, var)`,
    `call` telling apart the calls of one jitted function."""

    def __init__(self, model: keras.layers.Layer, specs: Any):
        closed = trace._jaxpr(model, specs)
        self._chains = trace._Chains(model)
        self._calls = 0
        self._dtypes: dict = {}
        self.ops: list[_Op] = []
        top = self._inline(closed.jaxpr, "", {}, 0)
        self.outputs = {
            top[v]
            for v in closed.jaxpr.outvars
            if not trace._is_literal(v) and trace._float(v)
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
                self._dtypes[keys[var]] = trace._float(var)
            return keys[var]

        for var in jaxpr.invars:
            key(var)
        for eqn in jaxpr.eqns:
            name = trace._join(prefix, eqn)
            inputs = [key(v) for v in eqn.invars if not trace._is_literal(v)]
            inner = trace._subjaxprs(eqn) if eqn.primitive.name in _CALLS else []
            if len(inner) == 1:
                sub, operands = inner[0]
                self._calls += 1
                given = {
                    i: key(o)
                    for i, o in zip(sub.invars, operands, strict=False)
                    if not trace._is_literal(o)
                }
                made = self._inline(sub, name, given, self._calls)
                for outer, var in zip(eqn.outvars, sub.outvars, strict=True):
                    if not trace._is_literal(var):
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
            elif op.kind in _MOVES:
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
                if id(c) not in seen and c.kind in _MOVES:
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
        stack = [
            op
            for op in inside
            if any(
                self._float(k) and id(self._producer.get(k)) not in ids
                for k in op.inputs
            )
        ]
        seen: set[int] = set()
        while stack:
            op = stack.pop()
            if id(op) in seen or id(op) not in ids:
                continue
            seen.add(id(op))
            if len(op.chain) > depth or op.kind == _CAST:
                continue  # a sublayer's code, or a cast: the dtype stops here
            if op.kind not in _MOVES:
                return False  # its own math on what it was given
            stack.extend(
                c for k in op.outputs if self._float(k) for c in self._taking(k)
            )
        return True
