"""Makes what `examples/finetune.yaml` fine-tunes: a tiny KerasHub Llama
preset and a JSONL file of a synthetic instruction task. No download.

The preset is a one-layer Llama (random weights, a SentencePiece tokenizer
trained here on the task's words), first trained for a few seconds on the
base task: each letter is followed by the next one ("c d e f"). It is saved
with `save_to_preset`, as a real checkpoint would be. `make_preset` makes
a Gemma too, and larger ones.

The instruction task asks for a step other than one: the prompt
"step two from c" has the response "e g i k". A model that learned the base
task, fine-tuned on these records, learns to follow the instruction.

Run: python examples/finetune_data.py [DIR]   (default: finetune-example)
then: kmp finetune --config examples/finetune.yaml
"""

import io
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import keras_hub
import numpy as np
import sentencepiece

LETTERS = "abcdefghijklmnopqrstuvwxyz"
STEPS = {"two": 2, "three": 3}
RESPONSE_LENGTH = 4


def letters_from(start: int, step: int, n: int) -> str:
    return " ".join(LETTERS[(start + step * i) % len(LETTERS)] for i in range(n))


def records(n: int, rng) -> list[dict]:
    """Instruction records: "step two from c" -> "e g i k"."""
    out = []
    for _ in range(n):
        start = int(rng.integers(len(LETTERS)))
        word = str(rng.choice(list(STEPS)))
        step = STEPS[word]
        out.append(
            {
                "prompt": f"step {word} from {LETTERS[start]}",
                "response": letters_from(start + step, step, RESPONSE_LENGTH),
            }
        )
    return out


# Per architecture: the task's classes, the names of the tokenizer's start
# and end pieces, and the words of its chat format (Gemma's, as its own
# tokenizer holds them).
ARCHS = {
    "llama": ("Llama", "<s>", "</s>", ()),
    "gemma": ("Gemma", "<bos>", "<eos>", ("<start_of_turn>", "<end_of_turn>")),
}


def tokenizer(arch: str = "llama"):
    """A SentencePiece tokenizer trained on the task's words.

    Llama's is a word model: one piece per word. Gemma's is BPE, as Gemma's
    own is, so that its chat words split off the words they touch
    ("<start_of_turn>user"); it has room to merge each task word whole.
    """
    name, start, end, turns = ARCHS[arch]
    words = [*LETTERS, "step", "from", *STEPS]
    if turns:
        words += ["user", "model"]  # the roles Gemma's chat format writes
    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([" ".join(words)] * 20),
        model_writer=proto,
        # The words and <pad>, <unk>, <s>, </s>; for BPE, room for merges.
        vocab_size=80 if turns else len(words) + 4,
        user_defined_symbols=list(turns),
        model_type="bpe" if turns else "word",
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        pad_piece="<pad>",
        bos_piece=start,
        eos_piece=end,
        minloglevel=2,
    )
    return getattr(keras_hub.models, f"{name}Tokenizer")(proto=proto.getvalue())


def make_preset(
    directory: str,
    arch: str = "llama",
    hidden_dim: int = 64,
    num_layers: int = 1,
    steps: int = 150,
    seed: int = 0,
    key_value_heads: int = 2,
) -> None:
    """A small Llama or Gemma that learned the base task, saved as a preset."""
    keras.utils.set_random_seed(seed)
    name = ARCHS[arch][0]
    models = keras_hub.models
    tok = tokenizer(arch)
    shape = dict(
        vocabulary_size=tok.vocabulary_size(),
        num_layers=num_layers,
        num_query_heads=4,
        num_key_value_heads=key_value_heads,
        hidden_dim=hidden_dim,
        intermediate_dim=2 * hidden_dim,
    )
    if arch == "gemma":
        shape["head_dim"] = hidden_dim // 4
    backbone = getattr(models, f"{name}Backbone")(**shape)
    preprocessor = getattr(models, f"{name}CausalLMPreprocessor")(
        tok, sequence_length=16
    )
    lm = getattr(models, f"{name}CausalLM")(
        backbone=backbone, preprocessor=preprocessor
    )
    rng = np.random.default_rng(seed)
    text = [letters_from(int(rng.integers(26)), 1, 12) for _ in range(32 * steps)]
    lm.compile(optimizer=keras.optimizers.Adam(3e-3))
    lm.fit(text, batch_size=32, epochs=1, shuffle=False, verbose=0)
    lm.save_to_preset(directory)


def write_data(directory: str, seed: int = 1) -> None:
    """train.jsonl and eval.jsonl of the instruction task, in `directory`."""
    rng = np.random.default_rng(seed)
    for name, n in (("train", 960), ("eval", 64)):
        with open(os.path.join(directory, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records(n, rng))


def main(directory: str = "finetune-example") -> None:
    os.makedirs(directory, exist_ok=True)
    make_preset(os.path.join(directory, "preset"))
    write_data(directory)
    print(f"wrote {directory}/preset, {directory}/train.jsonl, {directory}/eval.jsonl")


if __name__ == "__main__":
    main(*sys.argv[1:])
