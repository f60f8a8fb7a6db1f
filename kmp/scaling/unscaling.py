"""Whether the gradients `apply()` receives are scaled: stated by the code
that hands them over, never guessed.

Each entry point has one contract, visible at the call site or in the
optimizer's type:

=====================================================  ======================
gradients handed over by                               taken as
=====================================================  ======================
`fit` (Keras's `train_step`), `opt.apply(grads)` /     gradients of
`opt.apply_gradients(...)` on `kmp.LossScaleOptimizer`  `scale_loss(loss)`:
(Keras 3's contract)                                   unscaled by kmp
`opt.apply(grads, vars, scaled=True)`                  the same, stated
`opt.apply(grads, vars, scaled=False)`: the gradients  as they are
of `kmp.ScaledGradientTape.gradient`, of
`get_unscaled_gradients`, or of a loss never scaled
`kmp.mixed_precision.LossScaleOptimizer`'s             as they are
`apply_gradients` / `apply` (tf.keras 2's contract:
the gradients `get_unscaled_gradients` returned)
`stateless_apply` on JAX (`fit`'s jitted step)          gradients of
                                                       `scale_loss(loss)`
=====================================================  ======================

One exception to Keras 3's contract is decided by kmp, and only where it is
exact: in a traced step (a `tf.function`, such as the step `fit` traces)
that scaled no loss and whose optimizer never handed out unscaled
gradients, gradients computed by a tape's backward pass in that trace
without reading the loss scale (a custom `train_step` that never calls
`scale_loss`) cannot hold the scale: they are applied as they are, with a
one-time warning naming the line to add. kmp reads this from TensorFlow's
traced graph, and checks that reading once per process on a tiny trace
whose answers are known (`_misread_cases`). Where the check fails, a traced
`apply` with no loss scaled raises an error naming the line to write
instead. Gradients that enter the traced function as values (its
arguments, captured tensors, a variable's value, or what is computed from
those alone) follow the contract.

What kmp records, per step context (the outermost graph being traced, or
eager execution) since the last `apply` there, is used to refuse sequences
that the contract makes wrong, never to decide (on TensorFlow; on JAX,
where no graph can be read, a loss scaled since the last apply decides,
and `scaled=` overrides it): gradients handed out
unscaled and then passed to an `apply` that would unscale them again, a
loss scaled inside a recording `ScaledGradientTape` (which scales it
already), scaled gradients passed to a tf.keras 2 `apply_gradients`. Two
more refusals where kmp cannot tell: an `apply` with no loss scaled in its
context once the optimizer has handed out unscaled gradients anywhere (a
tape in another function), and an eager `apply` with no loss scaled since
the last one. The records are Python objects of this process, never
saved; `scaled=` always decides.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import keras

from kmp._base import warn as _warn
from kmp.internals import keras_private
from kmp.scaling.config import LossScaleError

# How `apply` treats its gradients.
SCALED = "scaled"  # unscale them
UNSCALED = "unscaled"  # apply them as they are
NEVER_SCALED = "never scaled"  # as they are, and warn once


@dataclasses.dataclass
class _Context:
    scaled_losses: int = 0  # scale_loss / get_scaled_loss calls
    hand_outs: int = 0  # unscaled gradients handed out
    recording_tapes: int = 0
    applied: bool = False  # a step was applied here (telemetry reads it)


def _step_graphs() -> list:
    """The graph being built and those enclosing it, up to its function (a
    while-loop or cond body belongs to its function); [] when eager, and on
    JAX, which traces no TensorFlow graphs."""
    if keras.backend.backend() != "tensorflow":
        return []
    import tensorflow as tf

    if tf.executing_eagerly():
        return []
    graph = tf.compat.v1.get_default_graph()
    graphs = [graph]
    while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):
        graph = graph.outer_graph
        graphs.append(graph)
    return graphs


class Ledger:
    """The per-context records of one optimizer (see the module docstring)."""

    def __init__(self):
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._eager = _Context()
        # Whether unscaled gradients were ever handed out (for refusals only).
        self._handed_out_before = False

    def _context(self) -> _Context:
        graphs = _step_graphs()
        if not graphs:
            return self._eager
        key = graphs[-1]
        context = self._graphs.get(key)
        if context is None:
            context = self._graphs[key] = _Context()
        return context

    # --- what happened in this context -------------------------------------

    def scaled_loss(self) -> None:
        """A loss was scaled here; refuses a loss scaled inside a recording
        ScaledGradientTape, which scales it already."""
        context = self._context()
        if context.recording_tapes:
            raise LossScaleError(
                "The loss would be scaled twice: a kmp.ScaledGradientTape is "
                "recording, and its gradient() scales the loss itself. Pass the "
                "unscaled loss to tape.gradient(loss, variables) and drop "
                "scale_loss/get_scaled_loss, or use a plain tf.GradientTape "
                "with optimizer.scale_loss(loss)."
            )
        context.scaled_losses += 1

    def tape_entered(self) -> None:
        self._context().recording_tapes += 1

    def tape_exited(self) -> None:
        context = self._context()
        context.recording_tapes = max(0, context.recording_tapes - 1)

    def handed_out(self) -> None:
        """Unscaled gradients were handed out here."""
        self._context().hand_outs += 1
        self._handed_out_before = True

    # --- what apply does --------------------------------------------------

    def unscaled(self, grads, variables, *, scaled, contract, scale, owner) -> list:
        """The gradients handed to `owner.apply` as its inner optimizer must
        see them: unscaled where they are the gradients of a scaled loss
        (`decide`). `scale` is the owner's `LossScale`."""
        decision = self.decide(grads, scaled, contract, scale.value, scale.scaling)
        if not scale.scaling:
            return grads
        if decision == NEVER_SCALED and _warn.once(owner, "never scaled"):
            _warn.warn(NEVER_SCALED_WARNING)
        if decision == SCALED:
            return scale.unscale(grads, variables)
        return grads

    def decide(
        self,
        grads: list[Any],
        scaled: bool | None,
        contract: str,
        scale_variable: Any,
        scaling: bool = True,
    ) -> str:
        """How `apply` treats `grads`: `SCALED`, `UNSCALED` or `NEVER_SCALED`.

        Args:
            grads: The gradients `apply` received.
            scaled: What the caller stated (`None`: nothing).
            contract: The optimizer's contract when nothing is stated
                (`SCALED`: Keras 3's; `UNSCALED`: tf.keras 2's).
            scale_variable: The loss-scale variable, whose reads mark the
                gradients computed with the scale.
            scaling: Whether the loss is scaled at all (mode `'none'`: either
                reading gives the same update, so nothing is refused).

        Raises:
            LossScaleError: for a sequence the contract makes wrong.
        """
        current = self._context()
        eager = current is self._eager
        # What happened since the last apply in this context; the next apply
        # starts afresh.
        context = dataclasses.replace(current)
        current.scaled_losses = current.hand_outs = 0
        if scaled is not None:
            return SCALED if scaled else UNSCALED
        if not scaling:
            return UNSCALED
        if contract == UNSCALED:
            if context.scaled_losses and not context.hand_outs:
                raise LossScaleError(
                    "This optimizer keeps tf.keras 2's contract: apply_gradients "
                    "takes the unscaled gradients that get_unscaled_gradients "
                    "returns, and a loss was scaled here with none unscaled. "
                    "Unscale them first: grads = "
                    "optimizer.get_unscaled_gradients(scaled_grads); or, if they "
                    "are the gradients of the scaled loss, say so: "
                    "optimizer.apply(grads, variables, scaled=True)."
                )
            return UNSCALED
        if keras.backend.backend() == "jax":
            # No traced graph to read: a loss scaled in this step's code
            # (scale_loss runs in Python while JAX traces) decides.
            if context.scaled_losses:
                return SCALED
            raise LossScaleError(NO_LOSS_SCALED_ON_JAX)
        if context.hand_outs:
            raise LossScaleError(
                "apply() takes the gradients of scale_loss(loss) and unscales "
                "them, but unscaled gradients were handed out here (by "
                "kmp.ScaledGradientTape.gradient): "
                "unscaling those again would divide the update by the loss "
                "scale. Say which these are: optimizer.apply(grads, variables, "
                "scaled=False) for the unscaled ones, scaled=True for the "
                "gradients of scale_loss(loss). (To look at gradients without "
                "applying them, a plain tf.GradientTape hands out nothing.)"
            )
        if context.scaled_losses:
            return SCALED
        if self._handed_out_before:
            raise LossScaleError(
                "apply() received gradients with no loss scaled here, and this "
                "optimizer has handed out unscaled gradients before (by "
                "kmp.ScaledGradientTape.gradient), "
                "perhaps in another function: kmp cannot tell which these are. "
                "Say so: optimizer.apply(grads, variables, scaled=False) for "
                "unscaled gradients, scaled=True for the gradients of "
                "scale_loss(loss)."
            )
        if eager:
            raise LossScaleError(
                "apply() received gradients eagerly, and no loss was scaled "
                "since the last apply: kmp cannot tell whether they are the "
                "gradients of scale_loss(loss) (Keras's own wrapper assumes so "
                "and divides them by the loss scale) or of a loss never scaled "
                "(a custom train_step run eagerly). Scale the loss before taking "
                "gradients, loss = optimizer.scale_loss(loss), or say which "
                "they are: optimizer.apply(grads, variables, scaled=True) or "
                "scaled=False."
            )
        misread = _misread_cases()
        if misread:
            import tensorflow as tf

            raise LossScaleError(
                "apply() received gradients in a traced step that scaled no "
                "loss, and kmp cannot tell whether they are scaled on "
                f"TensorFlow {tf.__version__}. kmp reads that from the traced "
                "graph, and this TensorFlow fails kmp's check of that reading "
                f"({'; '.join(misread)}). Scale the loss before taking "
                "gradients: loss = optimizer.scale_loss(loss). Or say which "
                "they are: optimizer.apply(grads, variables, scaled=False) for "
                "the gradients of a loss never scaled, scaled=True for the "
                "gradients of scale_loss(loss)."
            )
        if _computed_without_the_scale(grads, scale_variable):
            return NEVER_SCALED
        return SCALED

    def applied(self) -> None:
        """A step was applied in this context."""
        self._context().applied = True

    def took_step(self) -> bool:
        """Whether a step was applied in this context since the last call (a
        training step: telemetry reports only there); resets it."""
        context = self._context()
        applied, context.applied = context.applied, False
        return applied


NO_LOSS_SCALED_ON_JAX = (
    "The optimizer takes the gradients of optimizer.scale_loss(loss) and "
    "unscales them, but no loss was scaled since its last apply: kmp cannot "
    "tell whether these gradients are scaled, and on JAX it cannot read that "
    "from the step. Scale the loss inside the function jax.value_and_grad "
    "differentiates, traced with this apply: loss = optimizer.scale_loss(loss). "
    "In a train_step, call self.optimizer.scale_loss inside a "
    "keras.StatelessScope over the optimizer's state (kmp's docs, the JAX "
    "page, show how). Or say which "
    "they are: stateless_apply(..., scaled=True) for the gradients of a loss "
    "scaled in another function, scaled=False for those of a loss never scaled."
)


def _tensors(grads) -> list:
    import tensorflow as tf

    out = []
    for g in grads:
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            out.extend([g.values, g.indices])
        else:
            out.append(g)
    return out


def _handles(variable) -> set[int]:
    """ids of the resource handles a read of `variable` starts from (one per
    replica under a tf.distribute strategy)."""
    found = set()
    candidates = [variable, getattr(variable, "value", None)]
    values = getattr(variable, "values", None)
    if isinstance(values, (list, tuple)):
        candidates.extend(values)
    for candidate in candidates:
        if candidate is None:
            continue
        inner = keras_private.backing_variable(candidate)
        for v in [inner, *getattr(inner, "values", ())]:
            handle = getattr(v, "handle", None)
            if handle is not None:
                found.add(id(handle))
    return found


# TensorFlow's GradientTape builds every gradient op of a traced backward
# pass under this name scope (tensorflow/python/eager/backprop.py).
_BACKWARD_SCOPE = "gradient_tape/"
_LEAVES = ("Placeholder", "ReadVariableOp", "VarHandleOp", "Const")


def _from_a_backward_pass(tensor, source) -> bool:
    """Whether `tensor` is computed, in this trace, from the output of a
    tape's backward pass (an op in its name scope), before any leaf."""
    seen: set[int] = set()
    stack = [tensor]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        op = t.op
        if _BACKWARD_SCOPE in op.name:
            return True
        if op.type in _LEAVES:
            continue
        stack.extend(source(i) for i in op.inputs)
    return False


def _computed_without_the_scale(grads, scale_variable) -> bool:
    """Whether every gradient is computed in this step's graphs by a tape's
    backward pass (not an argument, a captured value or a variable's value,
    nor computed from those alone) and none of them reads the loss scale
    (directly, or as an input of a call of another function): then they are
    the gradients of a loss no one scaled."""
    import tensorflow as tf

    # A walk over graphs in plain Python, which autograph must not convert.
    walk = tf.autograph.experimental.do_not_convert(_walk_without_the_scale)
    return walk(grads, scale_variable)


def _walk_without_the_scale(grads, scale_variable) -> bool:
    """`_computed_without_the_scale`'s walk over the step's graphs."""
    graphs = _step_graphs()
    tensors = _tensors(grads)
    if not graphs or not tensors:
        return False
    in_step = {id(g) for g in graphs}
    # The handle's captures, from the outermost graph inwards; and the values
    # an inner graph (a loop or cond body) captured from an enclosing one.
    scale = _handles(scale_variable)
    outer_value = {}
    for graph in reversed(graphs):
        for external, internal in getattr(graph, "captures", ()):
            if id(external) in scale:
                scale.add(id(internal))
            if id(getattr(external, "graph", None)) in in_step:
                outer_value[id(internal)] = external

    def source(t):
        while id(t) in outer_value:
            t = outer_value[id(t)]
        return t

    for t in tensors:
        t = source(t)
        op = getattr(t, "op", None)
        if op is None or id(getattr(t, "graph", None)) not in in_step:
            return False
        if op.type == "Placeholder":
            return False  # handed into the function as a value
        if not _from_a_backward_pass(t, source):
            return False  # e.g. a value read from a variable, or an argument
    seen: set[int] = set()
    stack = [source(t) for t in tensors]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if id(t) in scale:
            return False
        for inp in t.op.inputs:
            inp = source(inp)
            if id(inp) not in seen:
                stack.append(inp)
    return True


# What `_computed_without_the_scale` must read in the self-check's trace.
_KNOWN_ANSWERS = {
    "a loss never scaled, in a function": True,
    "a loss times the scale, in a function": False,
    "gradients handed in as an argument": False,
    "a loss never scaled, in a loop body": True,
    "a loss times the scale, in a loop body": False,
    "a loss never scaled, in a cond branch": True,
    "a loss times the scale, in a cond branch": False,
    "a loss times the scale in a nested function": False,
}


@functools.cache
def _misread_cases() -> tuple[str, ...]:
    """The self-check: the cases of a tiny trace, with known answers, that
    `_computed_without_the_scale` reads wrongly on this TensorFlow.

    That function reads TensorFlow internals: the backward pass's name
    scope, the leaf op types, a function's captures, the outer graph of a
    loop body or cond branch, and the inputs of a nested function's call.
    This checks them once per process, the first time kmp needs them, so
    that a TensorFlow that changed one makes kmp raise, never divide.

    The trace is built in a graph of its own, so the caller's trace,
    strategy and name scopes are left as they are. It is traced, never run.

    Returns:
        The cases read wrongly, each with what was read; empty where all
        are right.
    """
    import tensorflow as tf

    read: dict[str, Any] = {}
    try:
        with tf.Graph().as_default():
            w = tf.Variable(3.0)
            scale = keras.Variable(1024.0)  # as the optimizer's is

            @tf.function(autograph=False)
            def times_scale(loss):
                return loss * scale

            def read_gradients(case: str, scaled: bool, nested: bool = False):
                with tf.GradientTape() as tape:
                    loss = w * w
                    if nested:
                        loss = times_scale(loss)
                    elif scaled:
                        loss = loss * scale
                grads = tape.gradient(loss, [w])
                read[case] = _computed_without_the_scale(grads, scale)

            def cond_branch():
                read_gradients("a loss never scaled, in a cond branch", False)
                read_gradients("a loss times the scale, in a cond branch", True)
                return tf.constant(0)

            def loop_body(i):
                read_gradients("a loss never scaled, in a loop body", False)
                read_gradients("a loss times the scale, in a loop body", True)
                return i + 1

            def step(handed_in):
                read_gradients("a loss never scaled, in a function", False)
                read_gradients("a loss times the scale, in a function", True)
                read["gradients handed in as an argument"] = (
                    _computed_without_the_scale([handed_in], scale)
                )
                tf.while_loop(lambda i: i < 1, loop_body, [0])
                tf.cond(handed_in > 0, cond_branch, lambda: tf.constant(0))
                read_gradients(
                    "a loss times the scale in a nested function", True, nested=True
                )

            step = tf.function(step, autograph=False)
            step.get_concrete_function(tf.TensorSpec([]))
    except Exception as error:  # any change in what kmp reads
        return (f"the trace raised {error!r}",)
    return tuple(
        f"{case}: read {read.get(case)}, expected {answer}"
        for case, answer in _KNOWN_ANSWERS.items()
        if read.get(case) is not answer
    )


NEVER_SCALED_WARNING = (
    "kmp.LossScaleOptimizer.apply() received the gradients of a loss that was "
    "never scaled (a custom train_step or loop that does not call scale_loss; "
    "kmp read it from the traced step: no loss was scaled, and a backward "
    "pass there computed the gradients without meeting the loss scale). kmp "
    "applies them as they are; float16 gradients may underflow without "
    "scaling. Scale the loss before taking gradients: "
    "loss = optimizer.scale_loss(loss) (self.optimizer in a train_step). "
    "Where no layer computes in float16 (bfloat16, float32), build the "
    "optimizer with mode='none': it then scales nothing."
)
