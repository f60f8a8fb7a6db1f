"""kmp's part in `fit`'s train function: Keras's own function, run as it is,
with what kmp can only do once the model is built and once a step's logs
are known.

`kmp.compile` and `kmp.telemetry.attach` set `model.train_function` to a
`TrainFunction`, which
Keras's `make_train_function` then keeps (it makes a function only where
there is none). At its first call, inside `fit`:

* for a subclassed model that was not built when it was compiled, it
  builds the model from the shape of the inputs (as Keras does from a
  saved input shape: a symbolic call, nothing runs) and completes the
  precision plan (which layer produces the output of its `call` is read
  from a trace); where that cannot be done before the step (a dict of
  inputs, `train_on_batch` first), the plan is completed after the first
  step and the step traced again if a layer changed;
* where the model trains with Keras's own `train_step`, it builds the
  optimizer for the weights that step applies (`model.trainable_weights`)
  before the step (TensorFlow traces a step whose first trace created
  variables a second time, and plain Keras builds its optimizer in that
  trace), and where kmp fuses the update, it compiles it
  (`kmp.backend.fused.compile_ahead`: XLA's compiler then works before the
  step's activations exist, not beside them);
* it has Keras make its own train function, and calls it from then on;
* after that first step (and the first after
  `kmp.telemetry.attach(model, optimizers=...)`), it warns where the step
  applied a `kmp.LossScaleOptimizer` that kmp's telemetry does not report
  for the model (a model whose own `compile` took it, compiled without
  `kmp.compile` and attached without naming it).

After each call from `fit`, where the step's logs lack kmp's telemetry (a
`train_step` that returns its own dict, or a model whose state Keras locked
before kmp could add its metric), it adds the loss scale and the skipped
steps, read from the optimizers' variables after the step (no device sync:
the values travel with the logs, which Keras reads when it reads the loss).
`skipped_steps` (this epoch) is added only where Keras resets kmp's
telemetry metric at each epoch start (it is among `model.metrics`; a model
that overrides `metrics` gets `skipped_steps_total`). `train_on_batch`
returns the step's logs as the `train_step` wrote them.

After each call from `fit`, it stops a run that trains nothing
(`kmp.training.stall`), unless a `kmp.callbacks.NonFiniteGuard` watches
this `fit` (`watched_by`) and renewed its watch before this call.

Before each call, it ends a watch of the forward pass that its `fit` did
not renew (`kmp.diagnostics.forward_watch`), and the step is traced again.

On JAX it takes and returns what Keras's JAX function does: `(state,
iterator)` in, `(logs, state)` out. The telemetry is read from the state
the step returned, and the stall check reads its counters once in a few
steps (`StallCheck.check_queued`). `train_on_batch` gets both, as `fit` does.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import keras

from kmp._base import warn as _warn
from kmp.backend import data
from kmp.backend import fused
from kmp.backend import tracing
from kmp.backend.jax import devices as jax_devices
from kmp.backend.jax import state as jax_state
from kmp.planning import apply as plan_apply
from kmp.scaling import applies
from kmp.scaling import lora
from kmp.scaling import registry
from kmp.scaling.optimizer import LossScaleOptimizer
from kmp.training import stall

# (model, per_epoch, state) -> the telemetry logs read after a step (`state`:
# what the step returned on JAX, else None); (model) ->
# whether the per-epoch count can be reported. `kmp.telemetry` provides them.
LogsReader = Callable[[keras.Model, bool, Any], dict]
EpochCheck = Callable[[keras.Model], bool]


class TrainFunction:
    """`model.train_function` as kmp sets it (see the module docstring).

    Args:
        model: The model compiled.
        complete_plan: Whether to apply kmp's precision plan again once the
            model is built (it was not built when it was compiled).
        logs: Reads the telemetry after a step (`kmp.scaling.telemetry.step_logs`).
        per_epoch: Whether the per-epoch skip count can be reported
            (`kmp.scaling.telemetry.metric_in_metrics`).
    """

    def __init__(
        self,
        model: keras.Model,
        complete_plan: bool,
        logs: LogsReader,
        per_epoch: EpochCheck,
    ):
        self._model = weakref.ref(model)
        self._complete_plan = complete_plan
        self._logs = logs
        self._epoch_check = per_epoch
        self._inner = None
        # Given with a retrace: what changed, for the error of a step that
        # then fails on mixed dtypes.
        self._changed: str | None = None
        self._adds: bool | None = None  # decided at the first step from fit
        self._per_epoch = False
        self._check = True  # whether the next step's applies are checked
        self._watcher: Callable[[], Any] | None = None  # see `watched_by`
        self._watch_renewed = False
        self._stall_check = stall.StallCheck()
        self._last_loss = None  # JAX: the last step's mean loss, for the check

    def optimizers_changed(self) -> None:
        """The optimizers kmp reports for the model changed
        (`kmp.telemetry.attach(model, optimizers=...)`): the step is traced
        again, what kmp adds to its logs decided again, and what it applies
        checked again, at the next call."""
        self._adds = None
        self._check = True
        self.retrace()

    def __call__(self, *args: Any) -> Any:
        """One call from `fit` or `train_on_batch`. On TensorFlow it takes
        `(iterator)` and returns the logs; on JAX `(state, iterator)` and
        returns `(logs, state)`, as Keras's own function does."""
        jax = keras.backend.backend() == "jax"
        state, iterator = args if jax else (None, args[0])
        model = self._model()
        optimizer = getattr(model, "optimizer", None)
        if isinstance(optimizer, LossScaleOptimizer) and (
            optimizer._forward_watch is not None and optimizer._forward_watch.lapsed()
        ):
            # A watch of the forward pass that its fit did not renew: ended.
            self.retrace()
        watched = None
        if state is not None:
            # JAX: the stall check reads queued counters, before this step
            # is dispatched (StallCheck.check_queued).
            watched = self._watched()
            if watched:
                self._stall_check.forget()
            else:
                self._stall_check.check_queued(model, self._last_loss)
        if self._check:
            # The first call, or the first after the optimizers reported
            # changed: which loss-scale optimizers the step (traced then)
            # applies.
            with applies.recorded() as applied:
                result = self._step(model, args)
            self._check = False
            _warn_of_unreported(model, applied)
        else:
            result = self._step(model, args)
        logs, state = result if state is not None else (result, None)
        if state is not None and isinstance(logs, dict):
            self._last_loss = logs.get("loss")  # an array: read only in an error
        if self._complete_plan:
            # Built only by the first step's own trace: the plan is completed
            # now (or never, where kmp cannot trace the model), and the next
            # step is traced again if a layer changed.
            self._complete_plan = False
            if plan_apply.ready(model) and plan_apply.complete(model):
                self._inner = self._keras_function(model, state)
        if not _from_fit(iterator):
            return result
        if state is None and not self._watched():
            self._stall_check(model)
        elif state is not None and not watched:
            self._stall_check.queue(model, state)
        if not isinstance(logs, dict):
            return result
        extra = None
        if self._adds is None:
            self._per_epoch = self._epoch_check(model)
            extra = self._logs(model, self._per_epoch, state)
            self._adds = any(key not in logs for key in extra)
        if not self._adds:
            return result
        if extra is None:  # read once a call (on JAX, one copy of the state)
            extra = self._logs(model, self._per_epoch, state)
        logs = {**logs, **{k: v for k, v in extra.items() if k not in logs}}
        return logs if state is None else (logs, state)

    def watched_by(self, guard: Any) -> None:
        """Leaves the check for a stalled run to `guard` (a
        `kmp.callbacks.NonFiniteGuard`, from its `fit`'s start), or takes it
        back (None, at its end). Held by a weak reference: a guard no longer
        in use gives the check back. The guard renews the watch before each
        call (`renew_watch`); one it did not renew (its `fit` was
        interrupted) gives the check back too."""
        self._watcher = None if guard is None else weakref.ref(guard)
        self._watch_renewed = guard is not None

    def renew_watch(self) -> None:
        """The guard still watches: the next call leaves the check to it."""
        self._watch_renewed = self._watcher is not None

    def _watched(self) -> bool:
        """Whether a guard watches this call (and takes its renewal)."""
        if self._watcher is None or self._watcher() is None:
            return False
        if not self._watch_renewed:
            self._watcher = None  # its fit ended without saying so
            return False
        self._watch_renewed = False
        return True

    def _step(self, model: keras.Model, args: tuple) -> Any:
        """One call of the step: the first, a changed one, or Keras's."""
        if self._inner is None:
            return self._first_call(model, args)
        if self._changed is not None:
            return self._changed_step(model, args)
        return self._inner(*args)

    def _first_call(self, model: keras.Model, args: tuple) -> Any:
        """What only the first call does before its step (see the module
        docstring), then that step."""
        if self._complete_plan and not plan_apply.ready(model):
            _build(model, args[-1])
        if self._complete_plan and plan_apply.ready(model):
            self._complete_plan = False
            plan_apply.complete(model)
        _ready_optimizer(model)
        state = _jax_state(args)
        if state is not None:
            jax_state.check_placement(model, state)
            _warn_of_dead_adapters(model, state)
        self._inner = self._keras_function(model, state)
        if self._changed is not None:
            # A change made before the first step, said if it fails.
            return self._changed_step(model, args)
        return self._first_step(model, args)

    def _first_step(self, model: keras.Model, args: tuple) -> Any:
        """The first step. Where its trace fails on mixed float dtypes and
        kmp gave float32 outputs to the user code it runs (a train_step that
        joins a model's output with a 16-bit tensor in raw TensorFlow), the
        error says so, with the rules that keep those outputs 16-bit: kmp
        cannot read a train_step's code, and does not guess and retry."""
        built = plan_apply.all_built(model)
        try:
            return self._inner(*args)
        except ValueError as e:
            if not jax_devices.refuses_float16_sums(e):
                raise
            raise ValueError(
                f"The training step of {model.name!r} multiplies float16 "
                "tensors and sums the products in float32, which XLA's CPU "
                "code does not run (plain Keras fails the same way). Float16 "
                "training on JAX needs a GPU. Received: policy "
                f"{model.dtype_policy.name!r} on JAX's CPU. Train in "
                "'mixed_bfloat16' or 'float32' there (kmp.set_policy('auto') "
                f"picks float32). XLA said: {tracing.error_line(e)}"
            ) from e
        except tracing.dtype_errors() as e:
            if not tracing.mixes_dtypes(e):
                raise
            outputs = plan_apply.float32_user_outputs(model)
            if not outputs:
                raise
            self._inner = None
            rules = "; ".join(
                f"kmp.set_layer_policy('name:{path}', {policy!r})"
                for path, policy in outputs
            )
            again = (
                "then kmp.compile it again"
                if built
                else "then build the model anew and kmp.compile it (layers "
                "first built in the failed step cannot be traced again; a "
                "model built anew names its layers anew, so give those "
                "layers a name= for the rules to find)"
            )
            raise TypeError(
                f"{tracing.error_line(e)}\n\nThe training step of "
                f"{model.name!r} joins an output kmp computes in float32 with "
                "a 16-bit tensor in raw TensorFlow, which does not mix dtypes. "
                "kmp cannot read a training step's code before it runs. Cast "
                "in the step: keras.ops.cast(y, h.dtype). Or keep those "
                f"outputs 16-bit, as plain Keras computes them: {rules}; "
                f"{again}."
            ) from e

    def _changed_step(self, model: keras.Model, args: tuple) -> Any:
        """The first step after a change that said what it was (see
        `retrace`): where its trace fails on mixed float dtypes, the error
        says what changed and what to do. kmp does not take the change back
        and retry."""
        try:
            result = self._inner(*args)
        except tracing.dtype_errors() as e:
            if not tracing.mixes_dtypes(e):
                raise
            # Kept: the next fit says it again while the change holds.
            raise TypeError(f"{tracing.error_line(e)}\n\n{self._changed}") from e
        self._changed = None
        return result

    def retrace(self, changed: str | None = None) -> None:
        """Has Keras trace the step again at the next call (a layer's
        policy changed); before the first call, only `changed` is kept.

        Args:
            changed: Where the change may leave a step that mixes float
                dtypes (a layer moved to float32 whose output a train_step's
                raw TensorFlow joins with a 16-bit tensor), what changed and
                what to do: the error of the next step says it, if that step
                fails so. Without it, a text given before and not yet
                used is kept: the change it says still holds.
        """
        if self._inner is not None:
            self._inner = self._keras_function(self._model())
        if changed is not None:
            self._changed = changed

    def _keras_function(self, model: keras.Model, state: Any = None):
        """Keras's own train function for `model`. On JAX, `state` is the
        state `fit` hands over: Keras reads the variables' shardings from
        their values, which `fit` has taken out of them."""
        model.train_function = None
        try:
            if state is None:
                model.make_train_function()
            else:
                with keras.StatelessScope(jax_state.mapping(model, state)):
                    model.make_train_function()
            inner = model.train_function
        finally:
            model.train_function = self
        return inner


def retrace(model: keras.Model, changed: str | None = None) -> None:
    """Has the model's train function traced again before its next step,
    as `fit` calls it (kmp's, or one Keras made), and its test and predict
    functions made again when next used (a layer's policy changed, which a
    traced function does not see). `changed`: see `TrainFunction.retrace`
    (kmp's train function only)."""
    plan_apply.forget_traced(model)  # and of the models inside it
    function = getattr(model, "train_function", None)
    if isinstance(function, TrainFunction):
        function.retrace(changed)
    elif function is not None:
        model.make_train_function(force=True)


def _ready_optimizer(model: keras.Model) -> None:
    """Builds kmp's optimizer, and compiles its fused update, before the
    first step, where the model trains with Keras's own `train_step` (which
    applies `model.trainable_weights`: a model may override that property,
    or `trainable_variables`, to train part of itself) and every layer is
    built (so that the list is the step's).

    Built there, its variables are not created inside the step's first
    trace, which TensorFlow would then trace a second time. Compiled there
    (`kmp.backend.fused.compile_ahead`), XLA's compiler works before the
    step's activations exist, not beside them. A `train_step` of the
    model's own may apply other variables, or other optimizers, so nothing
    is done ahead for it."""
    optimizer = getattr(model, "optimizer", None)
    if not (
        type(model).train_step is keras.Model.train_step
        and isinstance(optimizer, LossScaleOptimizer)
        and plan_apply.all_built(model)
    ):
        return
    applied = model.trainable_weights  # what Keras's train_step applies
    if not applied:  # it applies nothing
        return
    if not optimizer.built:
        with model.distribute_strategy.scope():
            optimizer.build(applied)
    # Where Keras compiles the whole step with XLA, the update is part of
    # that program: one compiled alone would never run.
    if getattr(model, "jit_compile", False) is not True:
        fused.compile_ahead(optimizer, applied)


def _warn_of_unreported(model: keras.Model, applied: list) -> None:
    """Warns where the model's step applied a `kmp.LossScaleOptimizer` that
    kmp's telemetry does not report for it (a model whose own compile took
    it, compiled without `kmp.compile`): its loss scale and skipped steps
    would be missing from the logs."""
    reported = registry.optimizers_of(model)
    missed = [o for o in applied if not any(o is r for r in reported.values())]
    if not missed:
        return
    reads = ", ".join(
        f"{label}: {registry.describe(o)}" for label, o in reported.items()
    )
    applied_ones = ", ".join(registry.describe(o) for o in missed)
    _warn.warn(
        f"The train step of model {model.name!r} applied {applied_ones}, "
        f"which kmp's telemetry does not report (it reads "
        f"{reads or 'no optimizer'}): the loss scale "
        "and skipped steps of what the step applied will not be in the logs. "
        "Name the optimizers the model trains with: "
        "kmp.telemetry.attach(model, optimizers={'d_optimizer': "
        "model.d_optimizer, ...}) (kmp.compile(model, ...) names those passed "
        "to the model's own compile)."
    )


def _warn_of_dead_adapters(model: keras.Model, state: tuple) -> None:
    """On JAX, before the first step: the check `kmp.LossScaleOptimizer`
    makes at its first apply on TensorFlow (`kmp.scaling.lora`), on the
    values `state` holds."""
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, LossScaleOptimizer):
        with keras.StatelessScope(jax_state.mapping(model, state)):
            lora.warn_dead_adapters(optimizer, model.trainable_variables)


def _jax_state(args: tuple) -> Any:
    """The state of a call on JAX, `(state, iterator)`; None on TensorFlow."""
    return args[0] if keras.backend.backend() == "jax" else None


def _from_fit(iterator: Any) -> bool:
    """fit hands over a tf.data iterator (train_on_batch a generator). On
    JAX both hand over generators, and kmp's telemetry metric reports
    nothing there: every call is taken as fit's, so that train_on_batch
    returns the telemetry as it does on TensorFlow."""
    return keras.backend.backend() == "jax" or data.is_dataset_iterator(iterator)


def _build(model: keras.Model, iterator: Any) -> None:
    """Builds `model` for the inputs `iterator` yields, as Keras builds a
    model from its saved input shape (`build_from_config`: a symbolic call,
    nothing runs), where they are one tensor or a tuple or list of tensors.
    Without a strategy, Keras builds a model only inside its first traced
    step, after the layers' policies were read."""
    shape = data.input_shape(iterator)
    if shape is None:
        return
    with warnings.catch_warnings():
        # Where Keras cannot build it so, it says so and leaves it unbuilt:
        # the first step builds it, and the plan is completed after it.
        warnings.simplefilter("ignore")
        model.build_from_config({"input_shape": shape})


def install(
    model: keras.Model,
    complete_plan: bool,
    logs: LogsReader,
    per_epoch: EpochCheck,
) -> None:
    """Sets `model.train_function` to a `TrainFunction` (after `compile`,
    which clears it), unless it is one already."""
    if not isinstance(getattr(model, "train_function", None), TrainFunction):
        model.train_function = TrainFunction(model, complete_plan, logs, per_epoch)
