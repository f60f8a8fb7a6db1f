"""A `kmp finetune` run: the config's last checks, the plan, training with
checkpoints, and what it writes.

What it writes in `output_dir`:

- `adapter.lora.h5`: the LoRA weights (KerasHub's `save_lora_weights`), or
  `preset/`: the whole fine-tuned model (`save_to_preset`) for a full
  fine-tune;
- `merged/` (with `merge: true`): a preset with the adapters merged into
  the weights, which `keras_hub.models.CausalLM.from_preset` loads;
- `config.yaml`: the resolved config; `metrics.json`: the run's records;
- `checkpoint.npz`: what training changed so far (trainable weights,
  optimizer state, the update reached), from which `resume: true`
  continues; `logs/` (TensorBoard), `loss_scale.csv`, `loss_scale.png`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import sys
import zipfile
from typing import Any

import keras
import numpy as np

from kmp.backend import machine
from kmp.diagnostics import memory
from kmp.diagnostics.monitor import LossScaleMonitor
from kmp.optimizers import adam as kmp_adam
from kmp.precision import policy as policy_lib
from kmp.tools import bench
from kmp.tools import runs
from kmp.tools.finetune import data
from kmp.tools.finetune import interrupt
from kmp.tools.finetune import model as model_lib
from kmp.tools.finetune import progress
from kmp.tools.finetune import template as template_lib
from kmp.training import compile as compile_lib

CHECKPOINT = "checkpoint.npz"
# At most this many records a chat template fails on are listed per file,
# as the config lists bad lines.
MAX_LISTED = 5
# Keys a resumed run may change: they do not change what it trains.
MAY_CHANGE_ON_RESUME = (
    "resume",
    "logging_steps",
    "eval_steps",
    "save_steps",
    "merge",
    "output_dir",
)


@dataclasses.dataclass(frozen=True)
class Checked:
    """What the last checks resolved."""

    policy: str
    reason: str
    budget_mb: float | None
    template: template_lib.ChatTemplate | None  # None: the plain template


def check(config: Any) -> Checked:
    """The checks that need kmp: the policy (`'auto'` resolved) against the
    quantization, the memory budget's size, and a checkpoint to resume
    against the config. Raises the config's error listing every problem
    found, its own and these."""
    values, problems = config.values, []
    policy, reason = values["policy"], "as the config says"
    if policy == "auto":
        choice = machine.resolve_auto()
        policy, reason = choice.policy, f"'auto': {choice.reason}"
    known = policy in policy_lib.list_policies()
    if (
        known
        and values["quantize"] == "int8"
        and policy_lib.get(policy).compute_dtype == "float16"
    ):
        picks = (
            f"'auto' picks {policy} here"
            if values["policy"] == "auto"
            else (f"policy is {policy}")
        )
        problems.append(
            f"quantize: Keras refuses int8 weights under a float16 compute "
            f"dtype, and {picks}. Fix: policy: mixed_bfloat16, or quantize: int4."
        )
    budget = None
    if isinstance(values["memory_budget"], str):
        try:
            budget = bench.parse_memory(values["memory_budget"])
        except ValueError as e:
            problems.append(f"memory_budget: {e}")
    if values["batch_size"] == "auto" and keras.backend.backend() != "tensorflow":
        problems.append(
            "batch_size: 'auto' needs kmp's memory estimate, which reads "
            "TensorFlow's count of live tensors. Fix: a batch_size, or run "
            "under KERAS_BACKEND=tensorflow."
        )
    path = os.path.join(str(values["output_dir"]), CHECKPOINT)
    saved = None  # what the run to resume resolved
    if values["resume"] is True and os.path.isfile(path):
        saved = _saved_run(path)
        problems += _changed_since(saved["config"], values)
    template = None
    if values["data.template"] != "plain" and not config.problems:
        before = saved.get("template") if saved else None
        template = _chat_template(values, before, problems)
    config.check(problems)
    return Checked(policy, reason, budget, template)


def _chat_template(
    values: dict[str, Any], before: dict[str, str] | None, problems: list[str]
) -> template_lib.ChatTemplate | None:
    """The chat template `data.template` names, compiled, once it renders
    every record; else None, with what is wrong added to `problems`. A
    resumed run's (`before`: the checkpoint's sha256 and time of the
    template) renders the time of its first start, and must be the template
    the checkpoint was written with."""
    try:
        import jinja2
    except ImportError as e:
        raise ImportError(
            "data.template: chat templates are rendered with Jinja, which is not "
            "installed. Fix: pip install 'kmp[finetune]'."
        ) from e
    import keras_hub

    try:
        source = template_lib.read(values["model"], values["data.template"])
    except ValueError as e:
        problems.append(str(e))
        return None
    if before and before["sha256"] != source.sha256:
        problems.append(
            f"resume: the chat template ({source.origin}) is not the one the "
            "checkpoint was written with: the run would go on training on "
            "other text. Fix: put the template back, or start anew in another "
            "output_dir."
        )
        return None
    tokenizer = keras_hub.tokenizers.Tokenizer.from_preset(values["model"])
    names = {"bos_token": "start_token", "eos_token": "end_token"}
    names.update(pad_token="pad_token", unk_token="unk_token")
    tokens = {k: getattr(tokenizer, a, None) for k, a in names.items()}
    now = (
        datetime.datetime.fromisoformat(before["time"])
        if before
        else datetime.datetime.now()
    )
    try:
        chat = template_lib.ChatTemplate(
            source, {k: t for k, t in tokens.items() if t is not None}, now
        )
    except jinja2.TemplateSyntaxError as e:
        problems.append(
            f"data.template: {source.origin} is not a valid Jinja template: "
            f"{e.message} (line {e.lineno}). Fix: mend it, or data.template: plain."
        )
        return None
    failed = False
    for path in filter(None, (values["data.train"], values["data.eval"])):
        bad = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    chat.pieces(json.loads(line))
                except ValueError as e:
                    bad.append(f"{path}:{number}: {e}")
                except (TypeError, jinja2.TemplateError) as e:
                    bad.append(f"{path}:{number}: the chat template failed: {e}")
        problems += bad[:MAX_LISTED]
        if len(bad) > MAX_LISTED:
            problems.append(f"{path}: {len(bad) - MAX_LISTED} more bad records.")
        failed = failed or bool(bad)
    return None if failed else chat


def _saved_run(path: str) -> dict[str, Any]:
    """What the run that wrote the checkpoint at `path` resolved: its
    config, batch size, updates, policy, estimate and chat template."""
    with np.load(path) as saved:
        return json.loads(str(saved["run"]))


def _changed_since(before: dict[str, Any], values: dict[str, Any]) -> list[str]:
    """The keys whose values differ from those the checkpoint was written
    with (`before`), where they change what the run trains."""
    changed = [
        f"{name}: {before.get(name)!r} in the checkpoint, {value!r} now"
        for name, value in values.items()
        if name not in MAY_CHANGE_ON_RESUME and before.get(name) != value
    ]
    if not changed:
        return []
    return [
        f"resume: the checkpoint in {values['output_dir']!r} was written with "
        f"another config ({'; '.join(changed)}). Fix: resume with the config "
        "it was written with (config.yaml beside it), or a new output_dir."
    ]


def _optimizer(values: dict[str, Any], schedule: progress.WarmupSchedule):
    kwargs = dict(
        learning_rate=schedule,
        weight_decay=values["optimizer.weight_decay"],
        gradient_accumulation_steps=(
            values["optimizer.gradient_accumulation_steps"]
            if values["optimizer.gradient_accumulation_steps"] > 1
            else None
        ),
        clipnorm=values["optimizer.clipnorm"],
    )
    if values["optimizer.state_dtype"] == "float32":
        return keras.optimizers.AdamW(**kwargs)
    return kmp_adam.AdamW(state_dtype=values["optimizer.state_dtype"], **kwargs)


def _saved_variables(lm: Any) -> list:
    """The variables training changes: the trainable ones, the float8 scales
    Keras overwrites with their "gradient", and random seed states. The
    frozen base is left out: a resumed run loads it from the preset again."""
    return [
        v
        for v in lm.variables
        if v.trainable
        or getattr(v, "overwrite_with_gradient", False)
        or v.path.endswith("seed_generator_state")
    ]


class Checkpoint(progress.Updates):
    """Writes `output_dir/checkpoint.npz` every `save_steps` updates: the
    values of the variables training changes and of the optimizer's, and
    the update reached. The file is replaced whole (written beside, then
    renamed), so an interrupted run leaves the last one usable."""

    def __init__(
        self,
        path: str,
        run: dict[str, Any],
        accumulation: int,
        start: int,
        history: dict[str, list],
    ):
        super().__init__(accumulation, start)
        self.path = path
        self.run = run
        self.history = history  # the progress records and evaluations so far
        self.save_steps = run["config"]["save_steps"]

    def on_update(self, logs: dict) -> None:
        if self.save_steps and self.update % self.save_steps == 0:
            self.save()

    def save(self) -> None:
        # On JAX, Keras's `Callback.model` puts the step's state on the host.
        save(self.path, self.model, self.update, self.run, self.history)


def save(
    path: str, lm: Any, update: int, run: dict[str, Any], history: dict[str, list]
) -> None:
    """Writes the checkpoint of `lm` at `update` to `path` (an .npz file),
    replacing it, with `run` (the config and what the run resolved from it)
    and `history` (its records so far). Each variable's value is copied out
    and written in turn: the run's state is never held twice."""
    variables = _saved_variables(lm)
    partial = path + ".partial"
    with zipfile.ZipFile(partial, "w") as archive:

        def put(name: str, value: np.ndarray) -> None:
            with archive.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, value, allow_pickle=False)

        put("update", np.asarray(update))
        put("run", np.asarray(json.dumps(run)))
        put("history", np.asarray(json.dumps(history, default=float)))
        put("paths", np.asarray([v.path for v in variables]))
        # Shapes, not paths: an optimizer's name takes a suffix when another
        # was made in the same process.
        put("optimizer_shapes", np.asarray(json.dumps(_shapes(lm.optimizer))))
        for i, v in enumerate(variables):
            put(f"model/{i}", _numpy(v))
        for i, v in enumerate(lm.optimizer.variables):
            put(f"optimizer/{i}", _numpy(v))
    os.replace(partial, path)


def _shapes(optimizer: Any) -> list[list[int]]:
    """The shapes of an optimizer's variables, in order."""
    return [list(v.shape) for v in optimizer.variables]


def _numpy(variable: Any) -> np.ndarray:
    """A variable's value for an .npz file, which holds no bfloat16: those
    values as float32 (exactly), cast back when assigned."""
    value = keras.ops.convert_to_numpy(variable.value)
    return value.astype("float32") if value.dtype.name == "bfloat16" else value


def _update_in(path: str) -> int:
    """The update a checkpoint was written at."""
    with np.load(path) as saved:
        return int(saved["update"])


def restore(path: str, lm: Any, run: dict[str, Any]) -> int:
    """Assigns the checkpoint's values to `lm` and its (built) optimizer;
    returns the update it was written at.

    Raises:
        ValueError: where the checkpoint's run resolved its batch size,
            update count or policy otherwise (`'auto'` may pick anew), or
            holds other variables.
    """
    with np.load(path) as saved:
        before = json.loads(str(saved["run"]))
        resolved = [
            f"{k}: {before[k]!r} then, {run[k]!r} now"
            for k in ("batch_size", "updates", "policy")
            if before[k] != run[k]
        ]
        if resolved:
            raise ValueError(
                f"resume: the run in {path} resolved its config otherwise "
                f"({'; '.join(resolved)}). Fix: set them as they were (batch_size, "
                "policy), or start anew in another output_dir."
            )
        variables = _saved_variables(lm)
        paths = [str(p) for p in saved["paths"]]
        shapes = json.loads(str(saved["optimizer_shapes"]))
        if paths != [v.path for v in variables] or shapes != _shapes(lm.optimizer):
            raise ValueError(
                f"{path} holds the state of another model: its variables do not "
                "match this run's. Fix: resume with the config it was written "
                "with (config.yaml beside it), or start anew in another "
                "output_dir."
            )
        for i, v in enumerate(variables):
            v.assign(saved[f"model/{i}"])
        for i, v in enumerate(lm.optimizer.variables):
            v.assign(saved[f"optimizer/{i}"])
        return int(saved["update"])


@dataclasses.dataclass
class Plan:
    """What a run will do, printed before it starts (and by --dry-run)."""

    lines: list[str]
    lm: Any  # without its preprocessor: it trains on token arrays
    preprocessor: Any  # the preset's, put back before a preset is saved
    train: data.Tokens
    held_out: data.Tokens | None
    batch_size: int
    per_epoch: int  # updates per epoch: whole windows of batches
    updates: int
    estimate: memory.MemoryEstimate | None
    template: template_lib.ChatTemplate | None  # None: the plain template

    def __str__(self) -> str:
        return "\n".join(self.lines)

    @property
    def estimate_mb(self) -> float | None:
        """The estimated peak of tensors at the run's batch size."""
        return self.estimate.total_mb(self.batch_size) if self.estimate else None


def auto_batch(estimate: memory.MemoryEstimate, budget_mb: float, given: str) -> int:
    """The largest batch whose estimated peak fits `budget_mb` (the config's
    `memory_budget`, `given`).

    Raises:
        ValueError: where no batch fits, or where the estimate saw no
            growth with the batch (its tensors are below what the device's
            count sees), so that it bounds no batch size.
    """
    fits = estimate.largest_batch(budget_mb)
    if fits is None:
        raise ValueError(
            f"batch_size: 'auto' needs the step's memory to grow with the batch, "
            f"and the estimate saw no growth: each sample's tensors are below "
            f"the smallest this device counts ({estimate.uncounted_below_mb:g} "
            "MiB). Fix: set a batch_size."
        )
    if fits == 0:
        raise ValueError(
            f"batch_size: 'auto' found no batch within memory_budget {given}: "
            f"weights, optimizer state and the step need "
            f"{estimate.total_mb(1):,.0f} MiB at batch 1. Fix: a larger "
            "memory_budget, a quantized base, or method: lora."
        )
    return fits


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def plan(config: Any, checked: Checked) -> Plan:
    """Loads the model and the data as the run will, and says what it will
    do: the policy and why, the quantization, the LoRA targets, parameters,
    bytes per kind, the memory estimate and the batch size."""
    v = config.values
    policy_lib.set_policy(checked.policy)
    keras.utils.set_random_seed(v["seed"])
    lm = model_lib.load(v["model"])
    preprocessor, lm.preprocessor = lm.preprocessor, None
    base = model_lib.count(lm.weights)
    lines = [
        f"kmp finetune: {v['model']} ({type(lm).__name__}, "
        f"{keras.backend.backend()} backend)",
        f"  policy: {checked.policy} ({checked.reason})",
    ]
    if v["quantize"]:
        model_lib.quantize(lm, v["quantize"])
    if v["method"] == "lora":
        names = model_lib.lora_targets(lm, v["lora.targets"])
        model_lib.add_lora(lm, v["lora.rank"], v["lora.alpha"], names)
        lines.append(
            f"  method: LoRA rank {v['lora.rank']}, alpha {v['lora.alpha']:g}, on "
            f"{', '.join(names)}; base {v['quantize'] or 'not quantized'}"
        )
    else:
        lines.append("  method: full fine-tuning (every weight trains)")
    tokenizer = preprocessor.tokenizer
    start = end = None  # a chat template writes its own
    if checked.template is None and getattr(preprocessor, "add_start_token", True):
        start = tokenizer.start_token_id
    if checked.template is None and getattr(preprocessor, "add_end_token", True):
        end = tokenizer.end_token_id

    def tokenize(path: str) -> data.Tokens:
        return data.tokenize(
            data.read_jsonl(path), tokenizer, v["data.max_length"], start, end,
            checked.template,
        )  # fmt: skip

    tokens = tokenize(v["data.train"])
    if v["data.eval"]:
        held_out = tokenize(v["data.eval"])
        train = tokens
    else:
        train, held_out = data.split(tokens, v["data.eval_fraction"], v["seed"])
    sizes = model_lib.Sizes.of(lm, base)
    schedule_stub = progress.WarmupSchedule(v["optimizer.learning_rate"], 1, 0)
    optimizer = _optimizer(v, schedule_stub)
    checkpoint = os.path.join(v["output_dir"], CHECKPOINT)
    estimate = _estimate_in(checkpoint) if v["resume"] else None
    reused = estimate is not None
    if not reused and keras.backend.backend() == "tensorflow":
        sample = train.x

        def make_inputs(n: int) -> dict[str, np.ndarray]:
            rows = np.arange(n) % len(train)
            return {k: a[rows] for k, a in sample.items()}

        estimate = memory.estimate_memory(lm, make_inputs, optimizer)
    batch = v["batch_size"]
    if batch == "auto":
        batch = auto_batch(estimate, checked.budget_mb, v["memory_budget"])
    accumulation = v["optimizer.gradient_accumulation_steps"]
    batch = min(batch, max(1, len(train) // accumulation))
    per_epoch = len(train) // batch // accumulation
    if per_epoch < 1:
        raise ValueError(
            f"data.train: {len(train)} records make no update of "
            f"{batch} x {accumulation} (batch_size x gradient_accumulation_steps)"
            ". Fix: more records, or a smaller batch_size or accumulation."
        )
    updates = per_epoch * v["epochs"]
    if v["max_steps"]:
        updates = min(updates, v["max_steps"])
    optimizer_bytes = estimate.optimizer_mb * 2**20 if estimate else None
    lines.append(
        f"  parameters: {sizes.trainable:,} trainable of {sizes.total:,}; "
        f"weights {_mib(sizes.weights_bytes)}, gradients "
        f"{_mib(sizes.gradients_bytes)}"
        + (f", optimizer state {_mib(optimizer_bytes)}" if optimizer_bytes else "")
    )
    held = f", {len(held_out)} held out" if held_out is not None else ""
    written_by = {
        "plain": "the plain template",
        "preset": "the preset's chat template",
    }.get(v["data.template"], f"the chat template {v['data.template']}")
    lines.append(
        f"  data: {len(train)} sequences{held}, {train.token_ids.shape[1]} tokens "
        f"each at most ({train.tokens_per_row:.0f} on average), written by "
        f"{written_by}"
    )
    lines.append(
        f"  batch: {batch}"
        + (f" x {accumulation} accumulated" if accumulation > 1 else "")
        + f"; {updates} updates ({per_epoch} per epoch), learning rate "
        f"{v['optimizer.learning_rate']:g} ({v['optimizer.schedule']})"
    )
    estimate_mb = estimate.total_mb(batch) if estimate else None
    lines.append(
        f"  memory estimate: {estimate_mb:,.1f} MiB of tensors at the peak"
        + (" (measured when the run began)" if reused else "")
        if estimate
        else "  memory estimate: not measured (it reads TensorFlow's tensors)"
    )
    return Plan(
        lines, lm, preprocessor, train, held_out, batch, per_epoch, updates,
        estimate, checked.template,
    )  # fmt: skip


def _estimate_in(path: str) -> memory.MemoryEstimate | None:
    """The memory estimate the run that wrote the checkpoint at `path`
    measured (the same model and config), or None."""
    fields = _saved_run(path).get("estimate")
    return memory.MemoryEstimate(**fields) if fields else None


def _order(n: int, batch: int, seed: int, epoch: int) -> np.ndarray:
    """The rows of an epoch, shuffled by (seed, epoch), whole batches only:
    the same on a resumed run."""
    rows = np.random.default_rng([seed, epoch]).permutation(n)
    return rows[: n // batch * batch]


def train(config: Any, the_plan: Plan) -> dict[str, Any]:
    """Trains as planned, writing checkpoints, and returns the run's metrics."""
    v = config.values
    lm, batch = the_plan.lm, the_plan.batch_size
    out = v["output_dir"]
    os.makedirs(out, exist_ok=True)
    accumulation = v["optimizer.gradient_accumulation_steps"]
    schedule = progress.WarmupSchedule(
        v["optimizer.learning_rate"],
        the_plan.updates,
        round(v["optimizer.warmup_ratio"] * the_plan.updates),
        v["optimizer.schedule"],
        accumulation,
    )
    compile_lib.compile(
        lm,
        optimizer=_optimizer(v, schedule),
        # The mean over the tokens learned (the response's), not over every
        # position of the batch: padding and prompts do not dilute it.
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        ),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")],
    )
    lm.optimizer.build(lm.trainable_variables)
    checkpoint_path = os.path.join(out, CHECKPOINT)
    estimate, template = the_plan.estimate, the_plan.template
    run = {
        "config": v,
        "batch_size": batch,
        "updates": the_plan.updates,
        "policy": policy_lib.get_policy().name,
        "estimate": dataclasses.asdict(estimate) if estimate else None,
        "template": (
            {"sha256": template.source.sha256, "time": template.now.isoformat()}
            if template
            else None
        ),
    }
    start = restore(checkpoint_path, lm, run) if v["resume"] else 0
    with open(os.path.join(out, "config.yaml"), "w", encoding="utf-8") as f:
        import yaml

        yaml.safe_dump(config.nested(), f, sort_keys=False)
    train_rows = the_plan.train
    per_epoch = the_plan.per_epoch
    tokens_per_batch = train_rows.tokens_per_row * batch
    history = _earlier(checkpoint_path, start) if v["resume"] else {}
    records = history.setdefault("records", [])
    evaluations = history.setdefault("evaluations", [])
    logs = os.path.join(out, "logs")
    bar = progress.Progress(
        the_plan.updates, v["logging_steps"], accumulation, tokens_per_batch,
        schedule, first_update=start, log_dir=logs,
    )  # fmt: skip
    bar.records = records  # after the resumed run's
    checkpoints = Checkpoint(checkpoint_path, run, accumulation, start, history)
    checkpoints.set_model(lm)  # it saves at the end, also if nothing was left
    monitor = LossScaleMonitor(
        log_dir=logs,
        csv_path=os.path.join(out, "loss_scale.csv"),
        plot_path=os.path.join(out, "loss_scale.png"),
        every_n_steps=v["logging_steps"] * accumulation,
        initial_step=start * accumulation,
    )

    def evaluation_due(update: int) -> bool:
        if the_plan.held_out is None:
            return False
        every = v["eval_steps"] or per_epoch
        return update % every == 0 or update == the_plan.updates

    def evaluate_at(update: int) -> None:
        held = the_plan.held_out
        evaluations.append(evaluate(lm, held, batch, update, [interrupts]))
        bar.log(update, {k: evaluations[-1][k] for k in ("eval_loss", "eval_accuracy")})

    with contextlib.closing(bar), interrupt.StopOnInterrupt() as interrupts:
        if (
            start
            and evaluation_due(start)
            and all(e["update"] != start for e in evaluations)
        ):
            # The run stopped after its checkpoint, before this evaluation.
            evaluate_at(start)
        update = start
        step = batch * accumulation  # rows per update
        while update < the_plan.updates:
            # Train to the next epoch's end, evaluation or the last update.
            epoch, done = divmod(update, per_epoch)
            stop = min((epoch + 1) * per_epoch, the_plan.updates)
            if v["eval_steps"]:
                stop = min(stop, (update // v["eval_steps"] + 1) * v["eval_steps"])
            rows = _order(len(train_rows), step, v["seed"], epoch)
            part = train_rows.take(rows[done * step : (done + stop - update) * step])
            lm.fit(
                part.x,
                part.y,
                sample_weight=part.sample_weight,
                batch_size=batch,
                epochs=1,
                shuffle=False,
                verbose=0,
                callbacks=[bar, checkpoints, monitor, interrupts],
            )
            update = stop
            if evaluation_due(update):
                evaluate_at(update)
    checkpoints.save()
    return history


def _earlier(path: str, start: int) -> dict[str, list]:
    """The progress records and evaluations of the run that the checkpoint
    at `path` (written at update `start`) holds."""
    with np.load(path) as saved:
        history = json.loads(str(saved["history"]))
    return {k: [r for r in rows if r["update"] <= start] for k, rows in history.items()}


def evaluate(
    lm: Any, held: data.Tokens, batch: int, update: int, callbacks: list = ()
) -> dict[str, float]:
    """The held-out loss and accuracy (of the response tokens), printed."""
    loss, accuracy = lm.evaluate(
        held.x,
        held.y,
        sample_weight=held.sample_weight,
        batch_size=batch,
        verbose=0,
        callbacks=list(callbacks),
    )
    print(f"\nupdate {update}: held-out loss {loss:.4f}, accuracy {accuracy:.3f}")
    return {"update": update, "eval_loss": loss, "eval_accuracy": accuracy}


def finetune(config: Any, dry_run: bool = False) -> int:
    """Runs `kmp finetune` with a read config; returns the exit status."""
    checked = check(config)
    the_plan = plan(config, checked)
    print(the_plan)
    if dry_run:
        return 0
    path = os.path.join(config["output_dir"], CHECKPOINT)
    try:
        _train_and_save(config, the_plan, checked)
    except KeyboardInterrupt:
        where = (
            f"the last checkpoint is {path}, at update {_update_in(path)}; "
            "resume: true continues from it"
            if os.path.isfile(path)
            else "no checkpoint was written yet"
        )
        print(f"\nkmp finetune: interrupted; {where}.", file=sys.stderr)
        return 130
    return 0


def _train_and_save(config: Any, the_plan: Plan, checked: Checked) -> None:
    """Trains, then writes the adapters (or the preset), the merged preset
    and metrics.json, and prints where."""
    v = config.values
    metrics = train(config, the_plan)
    out, lm = v["output_dir"], the_plan.lm
    lm.preprocessor = the_plan.preprocessor
    if v["method"] == "lora":
        saved = os.path.join(out, "adapter.lora.h5")
        lm.backbone.save_lora_weights(saved)
        if v["merge"]:
            lm.save_to_preset(os.path.join(out, "merged"))
    else:  # the whole model: nothing to merge
        saved = os.path.join(out, "preset")
        lm.save_to_preset(saved)
    tensors = machine.tensors_peak_mb()
    metrics.update(
        policy=checked.policy,
        peak_memory_gib=runs.process_peak_mb() / 1024,
        peak_tensors_mib=tensors,
        estimate_mib=the_plan.estimate_mb,
        loss_scale=_scale(lm.optimizer),
        skipped_steps=int(keras.ops.convert_to_numpy(lm.optimizer.skipped_steps_total)),
    )
    with open(os.path.join(out, "metrics.json"), "w", encoding="utf-8") as f:
        json.dump(metrics, f, indent=2, default=float)
    measured = f"{tensors:,.1f} MiB" if tensors is not None else "not counted"
    estimated = ""
    if the_plan.estimate_mb and tensors:
        off = the_plan.estimate_mb / tensors - 1
        estimated = f" (estimated {the_plan.estimate_mb:,.1f}: {off:+.0%})"
    print(
        f"\nsaved {saved}; peak tensors {measured}{estimated}, process "
        f"{metrics['peak_memory_gib']:.2f} GiB; skipped steps "
        f"{metrics['skipped_steps']}"
    )


def _scale(optimizer: Any) -> float | None:
    if getattr(optimizer, "mode", "none") == "none":
        return None
    return float(keras.ops.convert_to_numpy(optimizer.loss_scale))
