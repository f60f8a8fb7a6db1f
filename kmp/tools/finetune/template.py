"""Chat templates: how a record becomes text, with the text to learn marked.

A chat template is a Jinja template, as Hugging Face checkpoints carry one
(`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`). It
is rendered as `transformers` renders it: sandboxed, with `messages`,
`add_generation_prompt`, the tokenizer's special tokens (`bos_token`,
`eos_token`, ...), `raise_exception` and `strftime_now`.

The text learned for an assistant message is what the message adds to the
conversation before it, rendered with the generation prompt: its content
and the turn's end marker. The template's own text around it is input only.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

# Where a Hugging Face checkpoint keeps its chat template, in the order
# `transformers` reads them.
FILES = ("chat_template.jinja", "tokenizer_config.json")


def find(model: str) -> str | None:
    """The chat template the checkpoint directory `model` carries, or None
    (KerasHub presets carry none)."""
    path = os.path.join(model, FILES[0])
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    path = os.path.join(model, FILES[1])
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        source = json.load(f).get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source}
        source = named.get("default")
    return source if isinstance(source, str) else None


def read(model: str, choice: str) -> str:
    """The template `data.template` names: the preset's (`'preset'`) or a
    Jinja file's. Raises a ValueError if the preset carries none."""
    if choice != "preset":
        with open(choice, encoding="utf-8") as f:
            return f.read()
    source = find(model)
    if source is None:
        raise ValueError(
            f"data.template: 'preset', but {model!r} carries no chat template "
            f"(KerasHub presets carry none; Hugging Face checkpoints keep one in "
            f"{' or '.join(FILES)}). Fix: data.template: plain, or the path of "
            "a Jinja chat template."
        )
    return source


class ChatTemplate:
    """A compiled chat template and the special tokens it may write.

    Args:
        source: The Jinja template.
        special_tokens: The values of `bos_token`, `eos_token`, ... as the
            template reads them.
    """

    def __init__(self, source: str, special_tokens: dict[str, str]):
        from jinja2 import ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)  # raises TemplateSyntaxError
        self._special_tokens = dict(special_tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **self._special_tokens,
        )

    def pieces(self, record: dict[str, Any]) -> list[tuple[str, bool]]:
        """The record as (text, learn it) pieces in order.

        Raises:
            ValueError: If the template writes a conversation's turns
                otherwise than one after the other (a later turn changes
                the text of an earlier one), so the learned text cannot be
                found.
        """
        messages = record.get("messages") or [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]},
        ]
        # The whole first: the template's own checks name what is wrong.
        whole = self.render(messages, add_generation_prompt=False)
        out, done = [], ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1], add_generation_prompt=False)
            _check_prefix(done, before, i)
            _check_prefix(before, through, i)
            out += [(before[len(done) :], False), (through[len(before) :], True)]
            done = through
        _check_prefix(done, whole, len(messages))
        out.append((whole[len(done) :], False))
        return [(text, learn) for text, learn in out if text]


def _check_prefix(head: str, text: str, turn: int) -> None:
    if not text.startswith(head):
        raise ValueError(
            f"the chat template writes message {turn} so that the text of the "
            "messages before it changes, so the text to learn cannot be found. "
            "Fix: a template that writes each message after the ones before "
            "it, or data.template: plain."
        )


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _raise(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)
