"""`kmp finetune`: the config and its checks, the plan, a run of the example
config that learns, its outputs loaded in a fresh process, and resume.

The model is a tiny KerasHub Llama preset that `examples/finetune_data.py`
makes here (random weights, a tokenizer trained on the task's words).
"""

import gc
import json
import os
import pathlib
import re
import runpy
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest

import kmp_cli
from kmp_cli import finetune_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "finetune.yaml")
LETTERS = 26  # the task's answers are letters: chance is 1 in 26
# The layers the example's `lora.targets: all-linear` puts adapters on.
TARGETS = [
    "attention_output",
    "feedforward_gate_dense",
    "feedforward_intermediate_dense",
    "feedforward_output_dense",
    "key",
    "query",
    "value",
]

# The tests that use the preset run on one worker, which builds it once.
on_the_preset = pytest.mark.xdist_group("finetune")


def parse(*argv: str):
    return kmp_cli.build_parser().parse_args(["finetune", *argv])


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The example's preset and data, made once."""
    where = tmp_path_factory.mktemp("finetune")
    maker = runpy.run_path(str(ROOT / "examples" / "finetune_data.py"))
    maker["main"](str(where))
    return where


def flags(made: pathlib.Path, out: pathlib.Path, *more: str) -> list[str]:
    """The example config, pointed at `made` and writing to `out`."""
    return [
        "finetune",
        "--config", EXAMPLE,
        "--model", str(made / "preset"),
        "--data.train", str(made / "train.jsonl"),
        "--data.eval", str(made / "eval.jsonl"),
        "--output_dir", str(out),
        *more,
    ]  # fmt: skip


def write(path: pathlib.Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_help_lists_every_key_with_its_default(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    out = " ".join(capsys.readouterr().out.split())
    for key in finetune_config.KEYS:
        assert f"--{key.name} VALUE" in out, key.name
    assert "[default: auto]" in out  # policy
    assert "[default: required]" in out  # model
    assert "(lora | full)" in out


def test_flags_override_the_file_and_are_read_as_yaml(tmp_path):
    config = write(
        tmp_path / "c.yaml",
        "quantize: int4\nlora:\n  rank: 4\n  targets: [query, value]\nepochs: 2\n",
    )
    read = finetune_config.read(
        parse(
            "--config", config, "--lora.rank", "16", "--quantize", "null",
            "--optimizer.learning_rate", "2e-4",
        )
    )  # fmt: skip
    assert not [p for p in read.problems if "learning_rate" in p]
    assert read["optimizer.learning_rate"] == 2e-4  # YAML 1.1 reads text
    assert read["lora.rank"] == 16
    assert read["quantize"] is None
    assert read["lora.targets"] == ["query", "value"]
    assert read["epochs"] == 2
    assert read["policy"] == "auto"  # the default
    assert read.nested()["lora"]["rank"] == 16


def test_a_bad_config_lists_every_problem_and_loads_nothing(tmp_path, capsys):
    not_a_preset = tmp_path / "weights"
    not_a_preset.mkdir()
    (not_a_preset / "config.json").write_text('{"layers": 2}')
    data = write(
        tmp_path / "train.jsonl",
        '{"prompt": "a", "response": "b"}\n'
        '{"prompt": "a", "response": \n'  # line 2: cut short
        '{"prompt": "a"}\n'  # line 3: no response
        '{"messages": [{"role": "user", "content": "hi"}]}\n',  # line 4
    )
    config = write(
        tmp_path / "c.yaml",
        f"model: {not_a_preset}\n"
        "policy: mixed_float16\n"
        "quantize: int8\n"
        "lora:\n  rnak: 8\n"
        "epochs: two\n"
        "optimizer:\n  weight_decay: .nan\n"
        f"data:\n  train: {data}\n  eval: {tmp_path / 'missing.jsonl'}\n"
        f"output_dir: {tmp_path / 'out'}\n",
    )
    assert kmp_cli.main(["finetune", "--config", config]) == 2
    err = capsys.readouterr().err
    assert "the config has 9 problems; nothing was loaded or trained" in err
    assert "optimizer.weight_decay: expected a finite number; got nan." in err
    assert "lora.rnak: unknown key. Did you mean 'lora.rank'?" in err
    assert "epochs: expected a whole number; got 'two'." in err
    assert f"{data}:2: not JSON" in err
    assert f"{data}:3: " in err and "response missing" in err
    assert f"{data}:4: messages: no assistant message" in err
    assert "data.eval: no such file" in err
    assert "names neither a Keras class (registered_name) nor" in err
    assert "Keras refuses int8 weights under a float16 compute dtype, and " in err
    assert "policy is mixed_float16. Fix: policy: mixed_bfloat16" in err
    assert not (tmp_path / "out").exists()


@on_the_preset
def test_auto_is_resolved_before_the_int8_check(tmp_path, monkeypatch, made):
    monkeypatch.setenv("KMP_POLICY", "mixed_float16")  # what 'auto' picks
    argv = flags(made, tmp_path / "out", "--quantize", "int8", "--policy", "auto")
    with pytest.raises(finetune_config.ConfigError, match="'auto' picks mixed_float16"):
        from kmp.tools.finetune import run

        run.check(finetune_config.read(kmp_cli.build_parser().parse_args(argv)))


@on_the_preset
def test_a_setting_that_needs_another_is_named_with_its_fix(tmp_path, made):
    argv = flags(
        made, tmp_path / "out", "--batch_size", "auto", "--method", "full",
        "--lora.dropout", "0.1", "--resume", "true",
    )  # fmt: skip
    problems = finetune_config.read(kmp_cli.build_parser().parse_args(argv)).problems
    assert len(problems) == 4, problems
    assert any("memory_budget" in p and p.startswith("batch_size") for p in problems)
    assert any("quantize: int4 weights cannot be trained" in p for p in problems)
    assert any("Keras's LoRA layers apply no dropout" in p for p in problems)
    assert any("holds no checkpoint to resume from" in p for p in problems)


@on_the_preset
def test_float8_is_refused_with_lora(tmp_path, made):
    argv = flags(made, tmp_path / "out", "--quantize", "float8")
    [lora] = finetune_config.read(kmp_cli.build_parser().parse_args(argv)).problems
    assert lora.startswith("quantize: float8 is Keras's float8 training")
    assert lora.endswith("Fix: method: full, or quantize: int4 (QLoRA).")


@on_the_preset
def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, made, capsys):
    out = tmp_path / "out"
    argv = [*flags(made, out), "--data.eval", "null", "--data.eval_fraction", "0.1"]
    assert kmp_cli.main([*argv, "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert re.search(r"policy: \w+ \('auto': .+\)\n", plan)  # the choice and why
    assert f"LoRA rank 8, alpha 32, on {', '.join(TARGETS)};" in plan
    assert "base int4" in plan
    assert "trainable of" in plan and "optimizer state" in plan
    assert "864 sequences, 96 held out" in plan
    assert "batch: 16 x 2 accumulated; 81 updates (27 per epoch)" in plan
    assert re.search(r"memory estimate: [0-9.]+ MiB of tensors at the peak", plan)
    assert not out.exists()


def lora_weights(path: pathlib.Path) -> dict[str, np.ndarray]:
    found = {}
    with h5py.File(path) as f:
        f.visititems(
            lambda name, item: (
                found.__setitem__(name, item[()])
                if isinstance(item, h5py.Dataset)
                else None
            )
        )
    return found


@on_the_preset
@pytest.mark.slow
def test_the_example_learns_and_a_resumed_run_ends_where_one_run_does(
    tmp_path, made, capsys, monkeypatch
):
    """The example config (one epoch) learns the instruction task; a run
    interrupted after its first checkpoint and resumed ends with the same
    held-out losses and adapter weights as the run that was not."""
    more = ("--epochs", "1", "--save_steps", "10", "--eval_steps", "10")
    more += ("--merge", "true")
    whole = tmp_path / "whole"
    assert kmp_cli.main(flags(made, whole, *more)) == 0
    out = capsys.readouterr().out
    assert "30/30 ━━━━━━━━━━━━━━━━━━━━ · loss " in out
    assert "tokens/s · memory " in out
    metrics = json.loads((whole / "metrics.json").read_text())
    assert [e["update"] for e in metrics["evaluations"]] == [10, 20, 30]
    final = metrics["evaluations"][-1]
    assert final["eval_accuracy"] > 5 / LETTERS, final
    assert metrics["records"][-1]["tokens_per_second"] > 0
    assert (whole / "config.yaml").read_text().startswith("model: ")
    assert (whole / "loss_scale.png").stat().st_size > 0
    assert any((whole / "logs").iterdir())  # TensorBoard

    # Interrupted (Ctrl-C) once its first checkpoint is written, then
    # resumed. The SIGINT comes in a garbage-collection callback, as it can
    # on JAX, where the KeyboardInterrupt Python raises there is dropped.
    from kmp.tools.finetune import run

    def save_then_interrupt(self):
        written(self)

        def at_collection(phase, info):
            gc.callbacks.remove(at_collection)
            signal.raise_signal(signal.SIGINT)

        gc.callbacks.append(at_collection)
        gc.collect()

    written = run.Checkpoint.save
    cut = tmp_path / "cut"
    monkeypatch.setattr(run.Checkpoint, "save", save_then_interrupt)
    assert kmp_cli.main(flags(made, cut, *more)) == 130
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert "interrupted; the last checkpoint is" in err and "at update 10;" in err
    with np.load(cut / "checkpoint.npz") as saved:
        assert int(saved["update"]) == 10
    assert kmp_cli.main([*flags(made, cut, *more), "--resume", "true"]) == 0
    plan = capsys.readouterr().out
    assert "MiB of tensors at the peak (measured when the run began)" in plan
    resumed = json.loads((cut / "metrics.json").read_text())
    assert resumed["estimate_mib"] == metrics["estimate_mib"]
    assert [r["update"] for r in resumed["records"]] == [
        r["update"] for r in metrics["records"]
    ]  # the first run's records, then the resumed run's
    np.testing.assert_allclose(
        [e["eval_loss"] for e in resumed["evaluations"]],
        [e["eval_loss"] for e in metrics["evaluations"]],
        rtol=1e-4,
    )
    # TensorBoard counts batches on from the first run's, as one run does.
    from tensorboard.backend.event_processing import event_accumulator

    def steps(logs: pathlib.Path) -> dict[str, list[int]]:
        events = event_accumulator.EventAccumulator(str(logs))
        events.Reload()
        return {
            tag: [e.step for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]
        }

    first, again = steps(whole / "logs"), steps(cut / "logs")
    assert again["finetune/learning_rate"] == first["finetune/learning_rate"]
    assert first["finetune/learning_rate"] == [10, 20, 30, 40, 50, 60]
    assert again["finetune/eval_loss"] == [20, 40, 60]
    assert again["finetune/memory_gib"] == first["finetune/memory_gib"]
    assert again["kmp/loss"] == first["kmp/loss"] == [10, 20, 30, 40, 50, 60]
    one, two = (
        lora_weights(whole / "adapter.lora.h5"),
        lora_weights(cut / "adapter.lora.h5"),
    )
    assert one.keys() == two.keys() and len(one) > 2
    for name in one:
        np.testing.assert_allclose(one[name], two[name], rtol=1e-4, atol=1e-6)

    # In a fresh process without kmp: the merged preset loads, and so do
    # the adapters, put on the base as the guide says; both predict alike.
    check = f"""
import json, sys, keras, keras_hub, numpy as np
merged = keras_hub.models.CausalLM.from_preset({str(whole / "merged")!r})
lm = keras_hub.models.CausalLM.from_preset({str(made / "preset")!r})
lm.backbone.enable_lora(8, target_layer_names={TARGETS!r})
for layer in lm.backbone._flatten_layers():
    if getattr(layer, "lora_enabled", False):
        layer.lora_alpha = 32
lm.backbone.load_lora_weights({str(whole / "adapter.lora.h5")!r})
records = [json.loads(line) for line in open({str(made / "eval.jsonl")!r})]
x, _, _ = lm.preprocessor([r["prompt"] + "\\n" + r["response"] for r in records])
one, two = (np.argmax(keras.ops.convert_to_numpy(m(x)), -1) for m in (lm, merged))
mask = keras.ops.convert_to_numpy(x["padding_mask"])
agree = ((one == two) * mask).sum() / mask.sum()
print(type(merged).__name__, "kmp" in sys.modules, agree)
"""
    loaded = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=300, check=True,
    )  # fmt: skip
    name, imported, agree = loaded.stdout.split()
    assert (name, imported) == ("LlamaCausalLM", "False")
    # Keras merges an adapter into an int4 kernel by quantizing it again:
    # some predictions change (about 1 in 7 here).
    assert float(agree) > 0.75


class WordTokenizer:
    """A stand-in tokenizer: one id per word, in order of first sight."""

    pad_token_id = 0

    def __init__(self):
        self.ids = {}

    def __call__(self, texts):
        return [
            [self.ids.setdefault(w, len(self.ids) + 4) for w in t.split()]
            for t in texts
        ]


def test_only_the_response_and_the_end_token_are_learned():
    from kmp.tools.finetune import data

    records = [
        {"prompt": "add one to two", "response": "three"},
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello there"},
            ]
        },
    ]
    tokens = data.tokenize(records, WordTokenizer(), 32, start=2, end=3)
    # Row 0: <s> add one to two three </s>, padded to row 1's length.
    # Row 1: <s> system: be brief user: hi assistant: hello there </s>
    # The inputs are each row but its last token; the targets, the next.
    assert tokens.token_ids.shape == (2, 9)
    assert tokens.token_ids[:, 0].tolist() == [2, 2]
    assert tokens.padding_mask[0].tolist() == [1] * 7 + [0] * 2
    assert tokens.sample_weight[0].tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0]
    assert tokens.sample_weight[1].tolist() == [0] * 6 + [1, 1, 1]
    assert tokens.y[0, 5] == tokens.y[1, 8] == 3  # </s> is learned


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class SpecialWordTokenizer(WordTokenizer):
    """`WordTokenizer`, with special tokens that a text may hold."""

    special_tokens = ("<|im_start|>", "<|im_end|>")

    def __call__(self, texts):
        assert not any(t in text for t in self.special_tokens for text in texts)
        return super().__call__(texts)

    def token_to_id(self, token):
        return self.special_tokens.index(token) + 1


def compiled(text: str, **special_tokens: str):
    """A chat template of `text`, as `kmp finetune` compiles one."""
    import datetime

    from kmp.tools.finetune import template

    source = template.Source(text, "chat_template.jinja")
    return template.ChatTemplate(source, special_tokens, datetime.datetime(2026, 1, 2))


def test_a_chat_template_marks_each_assistant_turn_and_its_end_to_learn():
    from kmp.tools.finetune import data

    chat = compiled(CHATML)
    turns = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "bye"},
    ]
    pieces = chat.pieces({"messages": turns})
    assert "".join(text for text, _ in pieces) == chat.render(turns, False)
    learned = [text for text, learn in pieces if learn]
    assert learned == ["hello there<|im_end|>\n", "bye<|im_end|>\n"]

    tokenizer = SpecialWordTokenizer()
    pair = {"prompt": "add one", "response": "two"}
    tokens = data.tokenize([{"messages": turns}, pair], tokenizer, 64, None, None, chat)
    words = {i: w for w, i in tokenizer.ids.items()}
    words |= {1: "<|im_start|>", 2: "<|im_end|>"}

    def as_words(ids, where):
        rows = zip(ids, where, strict=True)
        return [[words[i] for i in row[w == 1]] for row, w in rows]

    # The special tokens are their own ids: <|im_end|> ends each turn learned.
    assert as_words(tokens.y, tokens.sample_weight) == [
        ["hello", "there", "<|im_end|>", "bye", "<|im_end|>"],
        ["two", "<|im_end|>"],
    ]
    assert as_words(tokens.token_ids, tokens.padding_mask)[1] == [
        "<|im_start|>", "user", "add", "one", "<|im_end|>", "<|im_start|>",
        "assistant", "two", "<|im_end|>",
    ]  # fmt: skip


def test_a_template_that_rewrites_earlier_turns_is_refused():
    backwards = compiled("{% for m in messages|reverse %}{{ m.content }}\n{% endfor %}")
    with pytest.raises(ValueError) as raised:
        backwards.pieces({"prompt": "hi", "response": "yo"})
    assert str(raised.value).startswith(
        "the chat template writes messages[1] after its prompt so that the text "
        "before it changes: expected it to go on from 'hi\\n', got 'yo\\nhi\\n' there."
    )
    with pytest.raises(ValueError, match=r"^messages\[0\]: a chat template writes"):
        compiled(CHATML).pieces({"messages": [{"role": "assistant", "content": "yo"}]})


def test_a_template_writes_the_same_date_all_run_long():
    dated = compiled(
        "{{ strftime_now('%d %b %Y') }}{% for m in messages %}{{ m.content }}"
        "{% endfor %}"
    )
    assert dated.pieces({"prompt": "hi", "response": "yo"}) == [
        ("02 Jan 2026hi", False),
        ("yo", True),
    ]


# Gemma's chat template, as its Hugging Face checkpoints carry it.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + "
    "'<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)


@on_the_preset
def test_a_chat_template_that_fails_is_named_before_the_model_loads(tmp_path, made):
    from kmp.tools.finetune import run

    def problems(*more):
        argv = flags(made, tmp_path / "out", *more)
        with pytest.raises(finetune_config.ConfigError) as raised:
            run.check(finetune_config.read(kmp_cli.build_parser().parse_args(argv)))
        return raised.value.problems

    [none] = problems("--data.template", "preset")
    assert "carries no chat template (KerasHub presets carry none;" in none
    broken = write(tmp_path / "broken.jinja", "{% for m in messages %}{{ m }}")
    [syntax] = problems("--data.template", broken)
    assert syntax.startswith(f"data.template: {broken} is not a valid Jinja template")
    chats = write(
        tmp_path / "chats.jsonl",
        '{"prompt": "hi", "response": "yo"}\n'
        '{"messages": [{"role": "system", "content": "be brief"}, '
        '{"role": "user", "content": "hi"}, '
        '{"role": "assistant", "content": "yo"}]}\n'
        '{"messages": [{"role": "assistant", "content": "yo"}]}\n',
    )
    gemma = write(tmp_path / "gemma.jinja", GEMMA_TEMPLATE)
    failed = f"{chats}:%d: the chat template failed: "
    assert problems("--data.template", gemma, "--data.train", chats) == [
        failed % 2 + "System role not supported",
        failed % 3
        + "Conversation roles must alternate user/assistant/user/assistant/...",
    ]
    # Resumed with another template than the checkpoint's run had.
    out = tmp_path / "resumed"
    out.mkdir()
    argv = flags(made, out, "--data.template", gemma)
    before = finetune_config.read(kmp_cli.build_parser().parse_args(argv)).values
    then = {"sha256": "0" * 64, "time": "2026-01-02T00:00:00"}
    saved = json.dumps({"config": before, "template": then})
    np.savez(out / "checkpoint.npz", run=np.asarray(saved))
    argv += ["--resume", "true"]
    config = finetune_config.read(kmp_cli.build_parser().parse_args(argv))
    with pytest.raises(finetune_config.ConfigError) as raised:
        run.check(config)
    [changed] = raised.value.problems
    assert f"resume: the chat template ({gemma}) is not the one the checkpoint" in (
        changed
    )


@pytest.mark.slow
def test_a_hugging_face_checkpoint_trains_on_its_own_chat_template(tmp_path, capsys):
    """A Gemma checkpoint in Hugging Face's format (as KerasHub exports one,
    with the config's `architectures` and Gemma's chat template added)
    fine-tunes on its template's text: the response and <end_of_turn>. It
    trains every weight under Keras's float8 training, whose scales the
    checkpoint holds."""
    from datetime import datetime

    import keras_hub

    maker = runpy.run_path(str(ROOT / "examples" / "finetune_data.py"))
    maker["make_preset"](
        str(tmp_path / "keras"), arch="gemma", key_value_heads=1, steps=30
    )
    maker["write_data"](str(tmp_path))
    hf = tmp_path / "hf"
    exported = keras_hub.models.CausalLM.from_preset(str(tmp_path / "keras"))
    exported.export_to_transformers(str(hf))
    for name, key, value in (
        ("config.json", "architectures", ["GemmaForCausalLM"]),
        ("tokenizer_config.json", "chat_template", GEMMA_TEMPLATE),
    ):
        config = json.loads((hf / name).read_text())
        (hf / name).write_text(json.dumps({**config, key: value}))
    out = tmp_path / "out"
    argv = [
        *flags(tmp_path, out, "--model", str(hf), "--data.template", "preset"),
        "--method", "full", "--quantize", "float8", "--max_steps", "12",
    ]  # fmt: skip
    assert kmp_cli.main(argv) == 0
    plan = capsys.readouterr().out
    assert "(GemmaCausalLM, " in plan
    assert "written by the preset's chat template\n" in plan
    # What it learned: the response and the turn's end marker.
    from kmp.tools.finetune import data
    from kmp.tools.finetune import template

    tokenizer = keras_hub.tokenizers.Tokenizer.from_preset(str(hf))
    chat = template.ChatTemplate(
        template.read(str(hf), "preset"), {"bos_token": "<bos>"}, datetime.now()
    )
    pair = {"prompt": "step two from c", "response": "e g i k"}
    rows = data.tokenize([pair], tokenizer, 64, None, None, chat)
    learned = rows.y[0][rows.sample_weight[0] == 1]
    assert [tokenizer.id_to_token(int(i)) for i in learned][:5] == [
        "▁e", "▁g", "▁i", "▁k", "<end_of_turn>",
    ]  # fmt: skip
    assert rows.token_ids[0, 0] == tokenizer.start_token_id  # <bos>, one id
    metrics = json.loads((out / "metrics.json").read_text())
    first, last = metrics["records"][0], metrics["records"][-1]
    assert last["loss"] < first["loss"]
    with np.load(out / "checkpoint.npz") as saved:
        paths = [str(p) for p in saved["paths"]]
    assert any(p.endswith("/kernel_amax_history") for p in paths), paths
    assert metrics["evaluations"][-1]["eval_accuracy"] > 2 / LETTERS


def test_long_records_are_cut_at_max_length():
    from kmp.tools.finetune import data

    records = [{"prompt": "a b c d e f", "response": "g h i j"}]
    tokens = data.tokenize(records, WordTokenizer(), 5, start=2, end=3)
    assert tokens.token_ids.shape == (1, 5)
    assert tokens.sample_weight[0].tolist() == [0, 0, 0, 0, 0]  # all prompt
    tokens = data.tokenize(records, WordTokenizer(), 8, start=2, end=3)
    assert tokens.sample_weight[0].tolist() == [0] * 6 + [1, 1]


def test_the_learning_rate_warms_up_then_decays():
    import keras

    from kmp.tools.finetune import progress

    def rates(shape, accumulation=1):
        schedule = progress.WarmupSchedule(1.0, 10, 2, shape, accumulation)
        return [
            float(keras.ops.convert_to_numpy(schedule(i * accumulation)))
            for i in range(11)
        ]

    cosine = rates("cosine")
    assert cosine[:3] == [0.5, 1.0, 1.0]
    assert cosine[6] == pytest.approx(0.5)  # half-way through the decay
    assert cosine[10] == pytest.approx(0.0, abs=1e-7)
    assert rates("linear")[6] == pytest.approx(0.5)
    assert rates("constant")[10] == 1.0
    assert rates("cosine", accumulation=4) == cosine  # counted in updates


def test_the_learning_rate_shown_is_the_optimizers_after_skipped_steps(capsys):
    from kmp.tools.finetune import progress

    # Warmup over 4 updates of 2 micro-batches: 0.25, 0.5, 0.75, 1.0.
    schedule = progress.WarmupSchedule(1.0, 10, 4, "cosine", accumulation=2)
    bar = progress.Progress(10, 1, 2, 1.0, schedule)
    # Micro-batches 2 and 3 overflow and are skipped: the optimizer applies
    # no update in the second window, so its learning rate stays at 0.25.
    for batch, skipped in enumerate([0, 0, 1, 2, 2, 2]):
        bar.on_train_batch_end(batch, {"loss": 1.0, "skipped_steps_total": skipped})
    assert [r["learning_rate"] for r in bar.records] == [0.25, 0.25, 0.5]
    assert "lr 2.50e-01 · skipped 2" in capsys.readouterr().out


def test_a_resumed_run_drops_the_values_logged_after_its_checkpoint(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    from kmp.tools.finetune import progress

    schedule = progress.WarmupSchedule(1.0, 10, 0, "constant")
    # The stopped run logged updates 1 to 5; its checkpoint was at update 3.
    for first, losses in ((0, [1.0] * 5), (3, [2.0] * 2)):
        bar = progress.Progress(
            10, 1, 2, 1.0, schedule, first_update=first, log_dir=str(tmp_path)
        )
        for batch, loss in enumerate(np.repeat(losses, 2)):
            bar.on_train_batch_end(batch, {"loss": loss, "skipped_steps_total": 0})
        bar.close()
    events = event_accumulator.EventAccumulator(str(tmp_path))
    events.Reload()
    # Steps count batches: two per update.
    assert [(e.step, e.value) for e in events.Scalars("finetune/loss")] == [
        (2, 1.0), (4, 1.0), (6, 1.0), (8, 2.0), (10, 2.0),
    ]  # fmt: skip


def test_a_ctrl_c_after_the_last_batch_still_stops_the_run():
    from kmp.tools.finetune import interrupt

    before = signal.getsignal(signal.SIGINT)
    # Raised at the block's end.
    with pytest.raises(KeyboardInterrupt), interrupt.StopOnInterrupt() as stop:
        signal.raise_signal(signal.SIGINT)  # only asks
        assert stop.asked
    assert signal.getsignal(signal.SIGINT) is before
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as for a background job
    try:
        with interrupt.StopOnInterrupt() as stop:
            signal.raise_signal(signal.SIGINT)
        assert not stop.asked
    finally:
        signal.signal(signal.SIGINT, before)


def test_auto_batch_is_the_largest_the_estimate_fits():
    from kmp.diagnostics.memory import MemoryEstimate
    from kmp.tools.finetune import run

    estimate = MemoryEstimate(
        weights_mb=100.0, optimizer_mb=20.0, optimizer="AdamW",
        gradients_mb=10.0, step_mb=30.0, per_sample_mb=5.0,
    )  # fmt: skip
    assert run.auto_batch(estimate, 400.0, "400M") == 50  # 150 + 50 * 5 <= 400
    with pytest.raises(ValueError, match="no batch within memory_budget 100M"):
        run.auto_batch(estimate, 100.0, "100M")
    flat = MemoryEstimate(100.0, 20.0, "AdamW", 10.0, 30.0, 0.0, 0.25)
    with pytest.raises(ValueError, match=r"saw no growth.*Fix: set a batch_size"):
        run.auto_batch(flat, 400.0, "400M")


def test_on_jax_a_checkpoint_in_mid_epoch_holds_the_trained_values(tmp_path):
    """On JAX, `fit` keeps the trained values out of the model's variables
    until its epoch ends: a checkpoint written inside the epoch must hold
    them (Keras's `Callback.model` puts them back)."""
    script = f"""
import shutil, keras, numpy as np
from kmp.tools.finetune import run
def make():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model
x, y = np.arange(64.0).reshape(16, 4) / 64, np.ones((16, 2))
two = make()  # two steps, then the epoch's end: its state on the host
two.fit(x[:4], y[:4], batch_size=2, shuffle=False, verbose=0)
expected = keras.ops.convert_to_numpy(two.layers[0].kernel.value)
model = make()
path = {str(tmp_path / "checkpoint.npz")!r}
saves = run.Checkpoint(
    path, {{"config": {{"save_steps": 2}}}}, accumulation=1, start=0, history={{}}
)
class Keep(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:  # the checkpoint of update 2, inside the epoch
            shutil.copy(path, path + ".kept.npz")
model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[saves, Keep()])
with np.load(path + ".kept.npz") as kept:
    print(int(kept["update"]), np.allclose(kept["model/0"], expected))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True,
        env={**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "True"]


@on_the_preset
def test_an_output_dir_that_is_a_file_or_bad_text_is_named(tmp_path, made):
    taken = tmp_path / "taken"
    taken.write_text("")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "caf\xe9", "response": "b"}\n'.encode("latin-1"))
    argv = flags(made, taken, "--data.train", str(latin1), "--seed", "-1")
    argv += ["--data.template", str(tmp_path / "chat.jinja")]
    problems = finetune_config.read(kmp_cli.build_parser().parse_args(argv)).problems
    assert len(problems) == 4, problems
    assert any(
        p.startswith("data.template: expected plain, preset or the path of a Jinja")
        and p.endswith("which is no file.")
        for p in problems
    )
    assert any("output_dir:" in p and "is a file" in p for p in problems)
    assert any(f"{latin1}:1: not UTF-8 text." in p for p in problems)
    assert any(p.startswith("seed: expected at least 0; got -1") for p in problems)
