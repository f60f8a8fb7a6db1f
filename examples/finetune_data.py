"""Makes what `examples/finetune.yaml` fine-tunes: a tiny KerasHub Llama
preset and a JSONL file of a synthetic instruction task. No download.

The preset is a small Llama (random weights, a SentencePiece tokenizer
trained here on the task's words), first trained for a few seconds on the
base task: each letter is followed by the next one ("c d e f"). It is saved
with `save_to_preset`, as a real checkpoint would be.

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


def tokenizer() -> keras_hub.models.LlamaTokenizer:
    """A SentencePiece tokenizer whose pieces are the task's words."""
    words = [*LETTERS, "step", "from", *STEPS]
    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([" ".join(words)] * 20),
        model_writer=proto,
        vocab_size=len(words) + 4,  # and <pad>, <unk>, <s>, </s>
        model_type="word",
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        minloglevel=2,
    )
    return keras_hub.models.LlamaTokenizer(proto=proto.getvalue())


def make_preset(directory: str, steps: int = 150, seed: int = 0) -> None:
    """A tiny Llama that learned the base task, saved as a preset."""
    keras.utils.set_random_seed(seed)
    tok = tokenizer()
    preprocessor = keras_hub.models.LlamaCausalLMPreprocessor(tok, sequence_length=16)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=tok.vocabulary_size(),
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
    )
    lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=preprocessor)
    rng = np.random.default_rng(seed)
    text = [letters_from(int(rng.integers(26)), 1, 12) for _ in range(32 * steps)]
    lm.compile(optimizer=keras.optimizers.Adam(3e-3))
    lm.fit(text, batch_size=32, epochs=1, shuffle=False, verbose=0)
    lm.save_to_preset(directory)


def main(directory: str = "finetune-example") -> None:
    os.makedirs(directory, exist_ok=True)
    make_preset(os.path.join(directory, "preset"))
    rng = np.random.default_rng(1)
    for name, n in (("train", 960), ("eval", 64)):
        with open(os.path.join(directory, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records(n, rng))
    print(f"wrote {directory}/preset, {directory}/train.jsonl, {directory}/eval.jsonl")


if __name__ == "__main__":
    main(*sys.argv[1:])
