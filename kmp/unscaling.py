"""Whether the gradients `apply()` receives are still scaled, decided from
where they came from, never from one flag shared by every call.

Three ways of training hand `kmp.LossScaleOptimizer.apply` gradients:

* Keras 3 (`fit`, a plain `tf.GradientTape` on `optimizer.scale_loss(loss)`):
  scaled gradients; `apply` unscales them.
* `kmp.ScaledGradientTape.gradient` and tf.keras 2's
  `get_unscaled_gradients`: unscaled gradients, clipped or not.
* A custom step that never scaled its loss: gradients that never were scaled.

A `Ledger` records, per step context (the outermost graph being traced,
so that a loop or condition body belongs to its function's step; or the
eager steps since the last `apply`), every loss it scaled and every set of
gradients it handed out unscaled, in order, holding weak references to
those tensors so that their identity is a mark (a tensor that is unchanged
by unscaling, such as a float8 scale's entry or any gradient under mode
`'none'`, marks nothing). `apply` then looks its gradients up (`decide`):

1. all of them handed out unscaled: applied as they are;
2. the scaled gradients that `get_unscaled_gradients` was given (unscaled
   copies taken, e.g. to log a norm): unscaled;
3. some of both: an error, not a guess;
4. unknown tensors (clipped, or otherwise computed from what was handed
   out or scaled): as the latest record says: a hand-out, applied as they
   are; a scaled loss, unscaled;
5. nothing in this context, with gradients computed in it (a graph's own
   ops: a custom train_step that never scaled its loss): applied as they
   are, with a one-time warning naming the line to add;
6. nothing in this context, with gradients from elsewhere (arguments of a
   `tf.function`, eager values): decided at run time from the step state
   another context left (`PENDING_*` in a variable): unscaled gradients
   handed out there are applied as they are, a loss scaled there means
   scaled gradients; with no such state they are taken as scaled, Keras's
   own `apply` semantics (its tests apply pre-scaled gradients directly),
   and eagerly, where kmp can tell, with a one-time warning.

The same ledger refuses the sequences that would scale twice: scaling a
loss inside a recording `ScaledGradientTape`, or unscaling gradients that
were handed out unscaled.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import tensorflow as tf

from kmp.loss_scale import LossScaleError

# What the last step context left for `apply`, at run time.
PENDING_NONE = 0
PENDING_SCALED_LOSS = 1
PENDING_UNSCALED = 2

# How `apply` treats its gradients.
SCALED = "scaled"  # unscale them
UNSCALED = "unscaled"  # apply them as they are
NEVER_SCALED = "never scaled"  # as they are, and warn once
AT_RUN_TIME = "at run time"  # from the pending-state variable

# Records kept per context, at most (code may take gradients it never
# applies); they hold weak references only.
_MAX_RECORDS = 64


def _refs(tensors) -> list:
    return [weakref.ref(t) for t in tensors if t is not None]


def _ids(refs) -> set[int]:
    return {id(t) for t in (r() for r in refs) if t is not None}


@dataclasses.dataclass
class _HandOut:
    seq: int
    unscaled: list  # weak references
    scaled: list  # weak references: what get_unscaled_gradients was given
    neutral: list  # weak references: left unchanged by unscaling


@dataclasses.dataclass
class _Context:
    seq: int = 0
    scaled_losses: list = dataclasses.field(default_factory=list)  # seqs
    hand_outs: list = dataclasses.field(default_factory=list)  # _HandOut
    recording_tapes: int = 0
    applied: bool = False  # a step was applied here (telemetry reads it)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq


def _step_graphs() -> list:
    """The graph being built and those enclosing it, up to its function (a
    while-loop or cond body belongs to its function); [] when eager."""
    if tf.executing_eagerly():
        return []
    graph = tf.compat.v1.get_default_graph()
    graphs = [graph]
    while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):
        graph = graph.outer_graph
        graphs.append(graph)
    return graphs


def _key():
    """The current step context: the outermost function graph being built,
    or None (eager)."""
    graphs = _step_graphs()
    return graphs[-1] if graphs else None


class Ledger:
    """The per-context record of one optimizer (see the module docstring)."""

    def __init__(self):
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._eager = _Context()

    def _context(self) -> _Context:
        key = _key()
        if key is None:
            return self._eager
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
        context.scaled_losses.append(context.next_seq())
        del context.scaled_losses[:-_MAX_RECORDS]

    def tape_entered(self) -> None:
        self._context().recording_tapes += 1

    def tape_exited(self) -> None:
        context = self._context()
        context.recording_tapes = max(0, context.recording_tapes - 1)

    def handing_out(self, scaled: list, unscaled: list) -> None:
        """`unscaled` (computed from `scaled`, which may be empty) is handed
        out as unscaled gradients; refuses to unscale gradients twice."""
        context = self._context()
        unchanged = {id(g) for g in scaled if g is not None} & {
            id(u) for u in unscaled if u is not None
        }
        known = set().union(*(_ids(h.unscaled) for h in context.hand_outs))
        if any(id(g) in known for g in scaled if g is not None):
            raise LossScaleError(
                "These gradients are unscaled already: they came from "
                "kmp.ScaledGradientTape.gradient or get_unscaled_gradients. "
                "Unscaling them again would divide them by the loss scale twice. "
                "Pass them to optimizer.apply(grads, variables) as they are."
            )
        seq = context.next_seq()
        if scaled and context.scaled_losses:
            # These are the gradients of the latest scaled loss: used up.
            context.scaled_losses.pop()
        context.hand_outs.append(
            _HandOut(
                seq,
                _refs(u for u in unscaled if u is not None and id(u) not in unchanged),
                _refs(g for g in scaled if g is not None and id(g) not in unchanged),
                _refs(u for u in unscaled if u is not None and id(u) in unchanged),
            )
        )
        del context.hand_outs[:-_MAX_RECORDS]

    # --- what apply does --------------------------------------------------

    def decide(self, grads: list[Any]) -> str:
        """How `apply` treats `grads` (`SCALED`, `UNSCALED`, `NEVER_SCALED`
        or `AT_RUN_TIME`), consuming the record it used; see the module
        docstring."""
        context = self._context()
        hand_outs = context.hand_outs
        given = {id(g) for g in grads if g is not None}
        neutral = set().union(*(_ids(h.neutral) for h in hand_outs))
        ids = given - neutral
        if given and not ids:  # unchanged by unscaling: either reading holds
            self._consume(hand_outs, lambda h: bool(_ids(h.neutral) & given))
            return UNSCALED
        unscaled = set().union(*(_ids(h.unscaled) for h in hand_outs))
        if ids and ids <= unscaled:
            self._consume(hand_outs, lambda h: bool(_ids(h.unscaled) & ids))
            return UNSCALED
        if ids & unscaled:
            raise LossScaleError(
                "apply() received a mix of gradients: some were handed out "
                "unscaled (by kmp.ScaledGradientTape.gradient or "
                "get_unscaled_gradients) and some not, so kmp cannot tell "
                "whether to unscale them. Pass all of one kind: the unscaled "
                "gradients (clipped as you like), or all the scaled ones."
            )
        known_scaled = set().union(*(_ids(h.scaled) for h in hand_outs))
        if ids and ids <= known_scaled:
            self._consume(hand_outs, lambda h: bool(_ids(h.scaled) & ids))
            return SCALED
        latest_hand_out = hand_outs[-1].seq if hand_outs else 0
        latest_loss = context.scaled_losses[-1] if context.scaled_losses else 0
        if latest_hand_out > latest_loss:
            del hand_outs[0]
            return UNSCALED
        if latest_loss:
            del context.scaled_losses[0]
            return SCALED
        if _computed_here(grads):
            return NEVER_SCALED
        return AT_RUN_TIME

    def applied(self) -> None:
        """A step was applied in this context."""
        self._context().applied = True

    def took_step(self) -> bool:
        """Whether a step was applied in this context since the last call (a
        training step: telemetry reports only there); resets it."""
        context = self._context()
        applied, context.applied = context.applied, False
        return applied

    @staticmethod
    def _consume(hand_outs: list, matches) -> None:
        for i, hand_out in enumerate(hand_outs):
            if matches(hand_out):
                del hand_outs[i]
                return


def _computed_here(grads) -> bool:
    """Whether the gradients are ops of this step's graphs (the graph being
    built or one enclosing it, up to its function; not the function's inputs
    or captured values): computed in this step, from a loss no one scaled
    here. Eager values carry no such record."""
    step = _step_graphs()
    if not step:
        return False
    found = False
    for g in grads:
        if g is None:
            continue
        tensor = g.values if isinstance(g, tf.IndexedSlices) else g
        op = getattr(tensor, "op", None)
        owner = getattr(tensor, "graph", None)
        if op is None or not any(owner is s for s in step):
            return False
        if op.type == "Placeholder":
            return False
        found = True
    return found
