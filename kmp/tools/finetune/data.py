"""Fine-tuning data: JSONL records made into token ids, with the loss on the
response's tokens alone.

A record is `{"prompt": ..., "response": ...}` or a chat,
`{"messages": [{"role": ..., "content": ...}, ...]}`. The plain template
writes a prompt/response pair as `prompt\\n` then `response`, and a chat as
one `role: content` line per message. The model learns the response (each
assistant message's content, in a chat) and the end token after it; the
prompt's tokens are inputs only (their sample weight is 0). A chat template
(`template.ChatTemplate`) writes the text, its start and end tokens too.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tokens:
    """Token arrays for causal LM training, one row per record.

    `x` is what the model takes (`token_ids`, `padding_mask`), `y` the next
    tokens, and `sample_weight` 1 where `y` is a token to learn.
    """

    token_ids: np.ndarray
    padding_mask: np.ndarray
    y: np.ndarray
    sample_weight: np.ndarray

    @property
    def x(self) -> dict[str, np.ndarray]:
        return {"token_ids": self.token_ids, "padding_mask": self.padding_mask}

    def __len__(self) -> int:
        return len(self.token_ids)

    def take(self, rows: np.ndarray) -> Tokens:
        """The rows `rows` (indices), in that order."""
        return Tokens(*(getattr(self, f.name)[rows] for f in dataclasses.fields(self)))

    @property
    def tokens_per_row(self) -> float:
        """The mean number of tokens a row holds (padding left out)."""
        return float(self.padding_mask.sum() / max(len(self), 1))


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The records of a JSONL file (already checked by the config)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def pieces(record: dict[str, Any]) -> list[tuple[str, bool]]:
    """The plain template: a record as (text, learn it) pieces in order."""
    if "messages" not in record:
        return [(record["prompt"] + "\n", False), (record["response"], True)]
    out = []
    for message in record["messages"]:
        learn = message["role"] == "assistant"
        out += [(f"{message['role']}: ", False), (message["content"], learn)]
        out.append(("\n", False))
    return out[:-1]  # no line break after the last message


def tokenize(
    records: list[dict[str, Any]],
    tokenizer: Any,
    max_length: int,
    start: int | None,
    end: int | None,
    template: Any = None,
) -> Tokens:
    """Token arrays of `records`, padded to the longest one (at most
    `max_length` tokens; longer ones are cut at the end).

    Args:
        records: Records as `read_jsonl` returns them.
        tokenizer: A KerasHub tokenizer (`tokenizer(list_of_strings)`).
        max_length: Tokens per row the model takes, at most.
        start: The token id put first, or None.
        end: The token id put after a learned last piece, or None.
        template: A `ChatTemplate`, or None for the plain template. The
            tokenizer's special tokens in its text become their ids.
    """
    if template is None:
        split, special = [pieces(r) for r in records], []
    else:
        split = [template.pieces(r) for r in records]
        special = [t for t in tokenizer.special_tokens if t]
    texts = [text for p in split for text, _ in p]
    ids = iter(_piece_ids(tokenizer, texts, special))
    rows, learn = [], []
    for p in split:
        row = [] if start is None else [start]
        flags = [False] * len(row)
        for _, learned in p:
            piece = next(ids)
            row += piece
            flags += [learned] * len(piece)
        if end is not None:
            row.append(end)
            flags.append(p[-1][1])
        rows.append(row[: max_length + 1])
        learn.append(flags[: max_length + 1])
    length = max(len(r) for r in rows) - 1
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    ids_array = np.full((len(rows), length + 1), pad, "int32")
    weight = np.zeros((len(rows), length + 1), "float32")
    present = np.zeros((len(rows), length + 1), "int32")
    for i, (row, flags) in enumerate(zip(rows, learn, strict=True)):
        ids_array[i, : len(row)] = row
        weight[i, : len(row)] = flags
        present[i, : len(row)] = 1
    return Tokens(
        token_ids=ids_array[:, :-1],
        padding_mask=present[:, :-1],
        y=ids_array[:, 1:],
        sample_weight=weight[:, 1:],
    )


def _piece_ids(tokenizer: Any, texts: list[str], special: list[str]) -> list[list[int]]:
    """Each text's token ids; a special token written in it is its own id."""
    if not special:
        return _token_lists(tokenizer, texts)
    # Longest first, so that no token is split at a shorter one it starts with.
    names = sorted(special, key=len, reverse=True)
    pattern = re.compile("(" + "|".join(map(re.escape, names)) + ")")
    parts = [pattern.split(text) for text in texts]  # specials at odd places
    words = [w for p in parts for w in p[::2] if w]
    lists = iter(_token_lists(tokenizer, words))
    out = []
    for p in parts:
        ids: list[int] = []
        for i, part in enumerate(p):
            if i % 2:
                ids.append(int(tokenizer.token_to_id(part)))
            elif part:
                ids += next(lists)
        out.append(ids)
    return out


def _token_lists(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Each text's token ids, as Python lists."""
    if not texts:
        return []
    out = tokenizer(texts)
    if hasattr(out, "to_list"):  # a tf.RaggedTensor
        out = out.to_list()
    return [np.asarray(t).reshape(-1).tolist() for t in out]


def split(tokens: Tokens, fraction: float, seed: int) -> tuple[Tokens, Tokens | None]:
    """(train, held out): `fraction` of the rows, drawn with `seed`."""
    if not fraction:
        return tokens, None
    order = np.random.default_rng(seed).permutation(len(tokens))
    held = max(1, round(fraction * len(tokens)))
    return tokens.take(np.sort(order[held:])), tokens.take(np.sort(order[:held]))
