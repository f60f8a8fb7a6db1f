"""Chat templates: how a record becomes text, with the text to learn marked.

A chat template is a Jinja template, as Hugging Face checkpoints carry one
(`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`). It
is rendered as `transformers` renders it: sandboxed, with `messages`,
`add_generation_prompt`, the tokenizer's special tokens (`bos_token`,
`eos_token`, ...), `raise_exception` and `strftime_now`. `strftime_now`
reads one time per run (a resumed run's is its first start's), so that a
template that writes the date writes the same text throughout.

The text learned for an assistant message is what the message adds to the
conversation before it, rendered with the generation prompt: its content
and the turn's end marker. The template's own text around it is input only.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from typing import Any

# Where a Hugging Face checkpoint keeps its chat template, in the order
# `transformers` reads them.
FILES = ("chat_template.jinja", "tokenizer_config.json")


@dataclasses.dataclass(frozen=True)
class Source:
    """A chat template's text and where it was read."""

    text: str
    origin: str  # a file's path

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def read(model: str, choice: str) -> Source:
    """The template `data.template` names: the preset's (`'preset'`) or a
    Jinja file's.

    Raises:
        ValueError: If the preset carries none, or a file cannot be read.
    """
    if choice != "preset":
        return Source(_text(choice), choice)
    path = os.path.join(model, FILES[0])
    if os.path.isfile(path):
        return Source(_text(path), path)
    path = os.path.join(model, FILES[1])
    found = None
    if os.path.isfile(path):
        try:
            found = json.loads(_text(path)).get("chat_template")
        except ValueError as e:
            raise ValueError(f"data.template: {path} is not JSON ({e}).") from e
    if isinstance(found, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in found}
        if "default" not in named:
            raise ValueError(
                f"data.template: {path} names chat templates {sorted(named)}, "
                "none of them 'default'. Fix: data.template: the path of a "
                "Jinja file holding the one to train with."
            )
        found = named["default"]
    if not isinstance(found, str):
        raise ValueError(
            f"data.template: 'preset', but {model!r} carries no chat template "
            f"(KerasHub presets carry none; Hugging Face checkpoints keep one in "
            f"{' or '.join(FILES)}). Fix: data.template: plain, or the path of "
            "a Jinja chat template."
        )
    return Source(found, path)


def _text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"data.template: {path} is not UTF-8 text ({e}).") from e


class ChatTemplate:
    """A compiled chat template and the special tokens it may write.

    Args:
        source: The Jinja template.
        special_tokens: The values of `bos_token`, `eos_token`, ... as the
            template reads them.
        now: The time `strftime_now` writes.

    Raises:
        jinja2.TemplateSyntaxError: If `source` is not a Jinja template.
    """

    def __init__(
        self, source: Source, special_tokens: dict[str, str], now: datetime.datetime
    ):
        from jinja2 import ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = now.strftime
        self.source = source
        self.now = now
        self._template = env.from_string(source.text)
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
            ValueError: If the chat opens with an assistant message, or the
                template writes a turn otherwise than after the text of the
                turns before it, so the text to learn cannot be found.
            jinja2.TemplateError: If the template refuses the record (its
                `raise_exception`).
        """
        messages = record.get("messages") or [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]},
        ]
        # The whole first: the template's own checks name what is wrong.
        whole = self.render(messages, add_generation_prompt=False)
        if messages[0]["role"] == "assistant":
            raise ValueError(
                "messages[0]: a chat template writes an assistant message after "
                "the prompt before it; got an assistant message first. Fix: "
                "open the chat with a user (or system) message, or "
                "data.template: plain."
            )
        out, done = [], ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1], add_generation_prompt=False)
            _check_prefix(done, before, f"the prompt of messages[{i}]")
            _check_prefix(before, through, f"messages[{i}] after its prompt")
            out += [(before[len(done) :], False), (through[len(before) :], True)]
            done = through
        _check_prefix(done, whole, "the messages after the last assistant one")
        out.append((whole[len(done) :], False))
        return [(text, learn) for text, learn in out if text]


def _check_prefix(head: str, text: str, what: str) -> None:
    """Raises unless `text` goes on from `head`."""
    if text.startswith(head):
        return
    at = next(
        (i for i, (a, b) in enumerate(zip(head, text, strict=False)) if a != b),
        min(len(head), len(text)),
    )
    raise ValueError(
        f"the chat template writes {what} so that the text before it changes: "
        f"expected it to go on from {head[at : at + 40]!r}, got "
        f"{text[at : at + 40]!r} there. The text to learn cannot be found. "
        "Fix: a template that writes each turn after the ones before it (and "
        "each assistant turn after its generation prompt), or "
        "data.template: plain."
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
