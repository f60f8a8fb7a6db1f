"""The config of `kmp finetune`: its keys, their defaults, and the checks
that run before any model is loaded.

A config is a YAML file of these keys (sections such as `lora:` nest the
dotted ones), and every key is also a flag (`--lora.rank 16`) that
overrides the file. A flag's value is read as YAML too: `--quantize null`,
`--lora.targets [query,value]`.

Reading needs no TensorFlow (so that `kmp finetune --help` answers at
once) and reports every problem it finds in one pass: unknown keys (with
the closest known one), wrong types, missing files, a preset directory of
no known format, JSONL lines that do not parse, and settings that do not
go together. The command then checks what needs kmp (the policy, `'auto'`
resolved, against the quantization; the memory budget; a checkpoint to
resume) and lists those problems with these (`Config.check`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
from collections.abc import Sequence
from typing import Any

POLICIES = ("auto", "mixed_bfloat16", "mixed_float16", "float32", "bfloat16")
QUANTIZATIONS = (None, "int8", "int4", "float8")
ROLES = ("system", "user", "assistant")
# What `resume` looks for in output_dir (kmp.tools.finetune.run writes it).
CHECKPOINT = "checkpoint.npz"
# At most this many bad lines are listed per data file.
MAX_LINES_LISTED = 5


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key: its dotted name, default, kind and help."""

    name: str
    default: Any
    kind: str  # see _check_value
    help: str
    choices: tuple = ()
    minimum: float | None = None  # inclusive, unless above
    maximum: float | None = None  # exclusive
    above: bool = False  # the value must be above minimum
    nullable: bool = False


REQUIRED = object()

KEYS = (
    Key(
        "model",
        REQUIRED,
        "dir",
        "a local KerasHub preset directory: one `save_to_preset` wrote, or a "
        "Hugging Face checkpoint KerasHub converts (never downloaded)",
    ),
    Key("task", "causal_lm", "choice", "what to train", choices=("causal_lm",)),
    Key(
        "policy",
        "auto",
        "choice",
        "the precision policy; 'auto' picks the fast, safe one for this machine",
        choices=POLICIES,
    ),
    Key(
        "quantize",
        None,
        "choice",
        "int8, int4: quantize the frozen base before adding LoRA (QLoRA); "
        "float8: Keras's float8 training, with method full",
        choices=QUANTIZATIONS,
    ),
    Key(
        "method",
        "lora",
        "choice",
        "lora: train adapters on a frozen base; full: train every weight",
        choices=("lora", "full"),
    ),
    Key("lora.rank", 8, "int", "the adapters' rank", minimum=1),
    Key(
        "lora.alpha",
        16.0,
        "float",
        "the adapters' output is scaled by alpha / rank",
        minimum=0,
        above=True,
    ),
    Key(
        "lora.dropout",
        0.0,
        "float",
        "dropout on the adapters' inputs (Keras's LoRA has none: 0 only)",
        minimum=0,
        maximum=1,
    ),
    Key(
        "lora.targets",
        "all-linear",
        "names",
        "'all-linear' (every Dense and EinsumDense of the backbone that takes "
        "LoRA), 'default' (the preset's own: query and value), or layer names",
    ),
    Key("optimizer.name", "adamw", "choice", "the optimizer", choices=("adamw",)),
    Key(
        "optimizer.learning_rate",
        2e-4,
        "float",
        "the peak learning rate",
        minimum=0,
        above=True,
    ),
    Key("optimizer.weight_decay", 0.01, "float", "AdamW's weight decay", minimum=0),
    Key(
        "optimizer.warmup_ratio",
        0.03,
        "float",
        "the fraction of steps over which the learning rate rises to its peak",
        minimum=0,
        maximum=1,
    ),
    Key(
        "optimizer.schedule",
        "cosine",
        "choice",
        "the learning rate after warmup",
        choices=("cosine", "linear", "constant"),
    ),
    Key(
        "optimizer.state_dtype",
        "float32",
        "choice",
        "the moments' dtype; bfloat16 (kmp.optimizers.AdamW) halves them",
        choices=("float32", "bfloat16"),
    ),
    Key(
        "optimizer.gradient_accumulation_steps",
        1,
        "int",
        "batches whose gradients are summed into one update",
        minimum=1,
    ),
    Key(
        "optimizer.clipnorm",
        None,
        "float",
        "clip each gradient to this norm (Keras's clipnorm), after unscaling",
        minimum=0,
        above=True,
        nullable=True,
    ),
    Key(
        "data.train",
        REQUIRED,
        "file",
        'a JSONL file: {"prompt": ..., "response": ...} or {"messages": [...]} '
        "per line",
    ),
    Key(
        "data.eval",
        None,
        "file",
        "a held-out JSONL file of the same form",
        nullable=True,
    ),
    Key(
        "data.eval_fraction",
        0.0,
        "float",
        "hold out this fraction of data.train instead",
        minimum=0,
        maximum=1,
    ),
    Key(
        "data.template",
        "plain",
        "template",
        "how a record becomes text: plain ('{prompt}\\n{response}'; a chat "
        "as 'role: content' lines), preset (the checkpoint's chat template), "
        "or the path of a Jinja chat template",
    ),
    Key(
        "data.max_length",
        512,
        "int",
        "tokens per sequence (longer ones are cut)",
        minimum=2,
    ),
    Key(
        "batch_size",
        8,
        "batch",
        "sequences per batch, or 'auto': the largest that fits memory_budget "
        "(TensorFlow only)",
        minimum=1,
    ),
    Key(
        "memory_budget",
        None,
        "size",
        "the memory batch_size 'auto' fits in, such as '4G' or '512M'",
        nullable=True,
    ),
    Key("epochs", 1, "int", "passes over the training data", minimum=1),
    Key(
        "max_steps",
        None,
        "int",
        "stop after this many updates (before the epochs end)",
        minimum=1,
        nullable=True,
    ),
    Key("output_dir", "finetune-output", "str", "where everything is written"),
    Key("logging_steps", 10, "int", "updates between progress lines", minimum=1),
    Key(
        "eval_steps",
        None,
        "int",
        "updates between evaluations on the held-out data (default: each epoch)",
        minimum=1,
        nullable=True,
    ),
    Key(
        "save_steps",
        100,
        "int",
        "updates between checkpoints in output_dir (null: one at the end)",
        minimum=1,
        nullable=True,
    ),
    Key(
        "resume",
        False,
        "bool",
        "continue from the last checkpoint in output_dir",
    ),
    Key(
        "merge",
        False,
        "bool",
        "also save a preset with the adapters merged into the weights",
    ),
    Key("seed", 0, "int", "the seed of LoRA's weights and the data order", minimum=0),
)
BY_NAME = {key.name: key for key in KEYS}
SECTIONS = sorted({key.name.split(".")[0] for key in KEYS if "." in key.name})


class ConfigError(ValueError):
    """A config with problems: every one found, one per line."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        count = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"the config has {count} problem{'s' * (count != 1)}; nothing was "
            f"loaded or trained:\n{lines}"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `--config`, `--dry-run` and one flag per key to `parser`."""
    parser.add_argument(
        "--config", metavar="FILE.yaml", help="the config file (keys below)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="load the config and the model, print the plan, and exit",
    )
    for key in KEYS:
        default = "required" if key.default is REQUIRED else _show(key.default)
        choices = f" ({' | '.join(map(_show, key.choices))})" if key.choices else ""
        parser.add_argument(
            f"--{key.name}",
            dest=key.name,
            metavar="VALUE",
            default=argparse.SUPPRESS,
            help=f"{key.help}{choices} [default: {default}]".replace("%", "%%"),
        )


@dataclasses.dataclass(frozen=True)
class Config:
    """A read config: every key's value (dotted names, defaults filled in)
    and the problems found so far."""

    values: dict[str, Any]
    problems: tuple[str, ...]

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def check(self, more: Sequence[str] = ()) -> None:
        """Raises a `ConfigError` listing the problems found, and `more`."""
        problems = [*self.problems, *more]
        if problems:
            raise ConfigError(problems)

    def nested(self) -> dict[str, Any]:
        """The values with dotted keys nested into sections, as a config
        file writes them."""
        out: dict[str, Any] = {}
        for name, value in self.values.items():
            section, _, rest = name.partition(".")
            if rest:
                out.setdefault(section, {})[rest] = value
            else:
                out[name] = value
        return out


def read(args: argparse.Namespace) -> Config:
    """The config that `args` name (the file, then its flags over it).

    Its problems leave out what needs kmp (the policy, `'auto'` resolved,
    against the quantization; the memory budget): the command checks those
    next (`Config.check`).
    """
    problems: list[str] = []
    given: dict[str, Any] = {}
    if args.config:
        given.update(_read_file(args.config, problems))
    for key in KEYS:
        if hasattr(args, key.name):
            given[key.name] = _flag_value(key.name, getattr(args, key.name), problems)
    values = {}
    for name, value in given.items():
        if name not in BY_NAME:
            problems.append(_unknown(name))
        else:
            values[name] = value
    bad = set()
    for key in KEYS:
        if key.name not in values:
            values[key.name] = None if key.default is REQUIRED else key.default
            if key.default is REQUIRED:
                bad.add(key.name)
                problems.append(
                    f"{key.name}: missing; expected {key.help}. Fix: set it in "
                    f"the config or pass --{key.name}."
                )
            continue
        values[key.name] = _float_written_as_text(key, values[key.name])
        problem = _check_value(key, values[key.name])
        if problem:
            bad.add(key.name)
            problems.append(problem)
    # Each key's problem is listed once: the checks of keys together and of
    # paths read a bad value's default instead (None for a required key).
    usable = {
        name: (None if BY_NAME[name].default is REQUIRED else BY_NAME[name].default)
        if name in bad
        else value
        for name, value in values.items()
    }
    problems += _check_together(usable)
    problems += _check_paths(usable)
    return Config({key.name: values[key.name] for key in KEYS}, tuple(problems))


def _show(value: Any) -> str:
    return (
        "null"
        if value is None
        else str(value).lower()
        if isinstance(value, bool)
        else str(value)
    )


def _yaml():
    try:
        import yaml
    except ImportError as e:
        raise ImportError(
            "kmp finetune reads its config with PyYAML, which is not installed. "
            "Fix: pip install 'kmp[finetune]'."
        ) from e
    return yaml


def _read_file(path: str, problems: list[str]) -> dict[str, Any]:
    """The file's keys, flattened to dotted names."""
    if not os.path.isfile(path):
        problems.append(f"--config: no such file: {path!r}.")
        return {}
    yaml = _yaml()
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        problems.append(f"{path}: not valid YAML: {e}")
        return {}
    except UnicodeDecodeError as e:
        problems.append(f"{path}: not UTF-8 text ({e}).")
        return {}
    if data is None:
        return {}
    if not isinstance(data, dict):
        problems.append(
            f"{path}: expected a mapping of keys to values at the top; got a "
            f"{type(data).__name__}."
        )
        return {}
    flat = {}
    for name, value in data.items():
        name = str(name)
        if name in SECTIONS:
            if not isinstance(value, dict):
                problems.append(
                    f"{name}: expected a section of keys (such as "
                    f"{_section_keys(name)}); got {value!r}."
                )
                continue
            for sub, inner in value.items():
                flat[f"{name}.{sub}"] = inner
        else:
            flat[name] = value
    return flat


def _section_keys(section: str) -> str:
    names = [k.name.split(".", 1)[1] for k in KEYS if k.name.startswith(section + ".")]
    return ", ".join(names[:3])


def _flag_value(name: str, text: str, problems: list[str]) -> Any:
    yaml = _yaml()
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        problems.append(f"--{name}: could not read {text!r} as a value.")
        return text


def _unknown(name: str) -> str:
    close = difflib.get_close_matches(name, BY_NAME, n=1, cutoff=0.6)
    if not close:  # a key put in the wrong section, or none
        last = name.rsplit(".", 1)[-1]
        close = [k for k in BY_NAME if k.rsplit(".", 1)[-1] == last]
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"{name}: unknown key.{hint} `kmp finetune --help` lists the keys."


def _float_written_as_text(key: Key, value: Any) -> Any:
    """`value`, or the number it writes for a float key. PyYAML reads
    `2e-4` (no dot, as YAML 1.1 wants) as text; people write it so."""
    if key.kind != "float" or not isinstance(value, str):
        return value
    try:
        return float(value)
    except ValueError:
        return value


def _check_value(key: Key, value: Any) -> str | None:
    """What is wrong with `value` for `key`, or None."""
    if value is None and (key.nullable or None in key.choices):
        return None
    expected = None
    if key.kind == "choice":
        if value not in key.choices:
            expected = "one of " + ", ".join(map(_show, key.choices))
    elif key.kind == "batch":
        if value != "auto" and not _is_number(value, int):
            expected = "a whole number or 'auto'"
    elif key.kind in ("int", "float"):
        kinds = int if key.kind == "int" else (int, float)
        if not (_is_number(value, kinds) and math.isfinite(value)):
            expected = "a whole number" if key.kind == "int" else "a finite number"
    elif key.kind == "bool":
        if not isinstance(value, bool):
            expected = "true or false"
    elif key.kind == "names":
        if not (
            value in ("all-linear", "default")
            or (
                isinstance(value, list)
                and value
                and all(isinstance(v, str) for v in value)
            )
        ):
            expected = "'all-linear', 'default' or a list of layer names"
    elif not isinstance(value, str) or not value:  # str, size, dir, file, template
        expected = {
            "dir": "a path",
            "file": "a path",
            "size": "a size such as '4G'",
            "template": "plain, preset or the path of a Jinja chat template",
        }
        expected = expected.get(key.kind, "a string")
    if expected:
        return f"{key.name}: expected {expected}; got {value!r}."
    if not _is_number(value, (int, float)):
        return None
    low = key.minimum is not None and (
        value <= key.minimum if key.above else value < key.minimum
    )
    high = key.maximum is not None and value >= key.maximum
    if low or high:
        return f"{key.name}: expected {_bounds(key)}; got {value!r}."
    return None


def _bounds(key: Key) -> str:
    if key.maximum is not None:
        return f"a number from {key.minimum:g} up to (not including) {key.maximum:g}"
    return (
        f"a number above {key.minimum:g}" if key.above else f"at least {key.minimum:g}"
    )


def _is_number(value: Any, kinds) -> bool:
    return isinstance(value, kinds) and not isinstance(value, bool)


def _check_together(v: dict[str, Any]) -> list[str]:
    """Settings that are each valid but do not go together."""
    problems = []
    if v["batch_size"] == "auto" and v["memory_budget"] is None:
        problems.append(
            "batch_size: 'auto' finds the largest batch within memory_budget, "
            "which is not set. Fix: set memory_budget (such as '4G') or a "
            "batch_size."
        )
    if v["quantize"] in ("int8", "int4") and v["method"] == "full":
        problems.append(
            f"quantize: {v['quantize']} weights cannot be trained, and method "
            "is full. Fix: method: lora (QLoRA), or quantize: null."
        )
    if v["quantize"] == "float8" and v["method"] == "lora":
        problems.append(
            "quantize: float8 is Keras's float8 training (every weight trains; "
            "its matmuls run in float8), and Keras's float8 layers take no "
            "LoRA; method is lora. Fix: method: full, or quantize: int4 (QLoRA)."
        )
    if v["lora.dropout"]:
        problems.append(
            f"lora.dropout: Keras's LoRA layers apply no dropout; got "
            f"{v['lora.dropout']!r}. Fix: lora.dropout: 0."
        )
    if v["data.eval"] and v["data.eval_fraction"]:
        problems.append(
            "data.eval and data.eval_fraction: both set; held-out data comes "
            "from one. Fix: drop one of them."
        )
    if v["eval_steps"] and not (v["data.eval"] or v["data.eval_fraction"]):
        problems.append(
            "eval_steps: set, but there is no held-out data. Fix: set data.eval "
            "or data.eval_fraction, or drop eval_steps."
        )
    return problems


def _check_paths(v: dict[str, Any]) -> list[str]:
    """The preset directory, the data files and the output directory."""
    problems = []
    problem = v["model"] and _check_preset(v["model"])
    if problem:
        problems.append(problem)
    for name in ("data.train", "data.eval"):
        if v[name]:
            problems += check_jsonl(name, v[name])
    template = v["data.template"]
    if template not in ("plain", "preset") and not os.path.isfile(template):
        problems.append(
            f"data.template: expected plain, preset or the path of a Jinja chat "
            f"template; got {template!r}, which is no file."
        )
    problems += _check_output(v["output_dir"], v["resume"])
    return problems


def _check_preset(path: str) -> str | None:
    """What is wrong with `path` as a KerasHub preset directory, or None.
    KerasHub reads a directory's format from its config.json: a Keras
    preset's names a `registered_name`, a Transformers checkpoint's a
    `model_type`."""
    fix = (
        "Fix: point model at a directory that `save_to_preset` wrote, or at a "
        "Hugging Face checkpoint directory (config.json and safetensors)."
    )
    if not os.path.isdir(path):
        what = "a file" if os.path.exists(path) else "nothing there"
        return f"model: expected a preset directory; got {path!r} ({what}). {fix}"
    config = os.path.join(path, "config.json")
    try:
        with open(config, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return f"model: {path!r} has no config.json, so it is no preset. {fix}"
    except (OSError, ValueError) as e:
        return f"model: {config} could not be read as JSON ({e}). {fix}"
    if not isinstance(data, dict) or not (
        "registered_name" in data or "model_type" in data
    ):
        return (
            f"model: {config} names neither a Keras class (registered_name) nor "
            f"a Transformers model (model_type): no format KerasHub reads. {fix}"
        )
    return None


def check_jsonl(name: str, path: str) -> list[str]:
    """The problems of a JSONL data file, each with its line number."""
    if not os.path.isfile(path):
        return [f"{name}: no such file: {path!r}."]
    bad = []
    records = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                bad.append(f"{path}:{number}: not UTF-8 text.")
                continue
            if not line.strip():
                continue
            records += 1
            try:
                record = json.loads(line)
            except ValueError as e:
                bad.append(f"{path}:{number}: not JSON ({e}).")
                continue
            problem = record_problem(record)
            if problem:
                bad.append(f"{path}:{number}: {problem}")
    if not records and not bad:
        return [f"{name}: {path!r} holds no records."]
    listed = bad[:MAX_LINES_LISTED]
    if len(bad) > len(listed):
        listed.append(f"{path}: {len(bad) - len(listed)} more bad lines.")
    return listed


def record_problem(record: Any) -> str | None:
    """What is wrong with one data record, or None."""
    form = (
        'expected {"prompt": "...", "response": "..."} or {"messages": '
        '[{"role": "user", "content": "..."}, ...]}'
    )
    if not isinstance(record, dict):
        return f"{form}; got a {type(record).__name__}."
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            return f"messages: expected a list of messages; got {messages!r}."
        for i, m in enumerate(messages):
            if not (
                isinstance(m, dict)
                and m.get("role") in ROLES
                and isinstance(m.get("content"), str)
            ):
                return (
                    f"messages[{i}]: expected role ({', '.join(ROLES)}) and "
                    f"content (a string); got {m!r}."
                )
        if not any(m["role"] == "assistant" for m in messages):
            return "messages: no assistant message, so nothing to learn."
        return None
    missing = [k for k in ("prompt", "response") if not isinstance(record.get(k), str)]
    if missing:
        return f"{form}; {' and '.join(missing)} missing or not a string."
    return None


def _check_output(path: str, resume: bool) -> list[str]:
    if os.path.exists(path) and not os.path.isdir(path):
        return [
            f"output_dir: {path!r} is a file; expected a directory to write "
            "in. Fix: another output_dir."
        ]
    checkpoint = os.path.join(path, CHECKPOINT)
    if resume and not os.path.isfile(checkpoint):
        return [
            f"resume: true, but {path!r} holds no checkpoint to resume from. "
            "Fix: resume: false to start a new run."
        ]
    if not resume and os.path.isfile(checkpoint):
        return [
            f"output_dir: {path!r} holds a run's checkpoint, which a new run "
            "would overwrite. Fix: resume: true to continue it, or a new "
            "output_dir."
        ]
    return []
