"""Chat and instruction data: a row's conversation rendered with a chat template, tokenized,
with the tokens the loss trains on marked.

A row holds ``messages`` (``messages_column``) or one exchange (``prompt_column``,
``response_column``). The rendered text is tokenized once with special-token names read as
special tokens (``apply_chat_template``'s ids), then an EOS unless it ends with one.
``train_on``: ``all``, ``assistant`` or ``last_assistant``. Assistant turn ``i`` spans from
where ``messages[:i]`` rendered with ``add_generation_prompt`` ends to where
``messages[:i + 1]`` rendered ends, less trailing whitespace (the end-of-turn token trained,
a newline after it not); a final turn rendered differently (Qwen3's ``<think>``) is followed
through its content. A token is trained when it starts inside a trained turn, the appended
EOS when the token before it is; other labels are ``IGNORE_INDEX``.
"""

from __future__ import annotations

import json
from typing import Any

from titan_train.data.chat_template import ChatTemplate, load_chat_template
from titan_train.data.config import DataSource
from titan_train.errors import DataError

__all__ = ["ChatEncoder", "build_chat_encoder", "chat_row", "check_chat_template"]

_PROBE = [
    {"role": "user", "content": "Hello?"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Bye?"},
    {"role": "assistant", "content": "Bye."},
]
"""A conversation most templates accept (roles alternate, user first): preflight renders it."""

_REASONING = ("reasoning_content", "thinking", "reasoning")


class ChatEncoder:
    """A chat row -> ``(ids, trained)``, per token whether the loss trains on it; ``columns``:
    ``(messages,)`` or ``(prompt, response)``; ``name``, ``section``: for errors."""

    def __init__(
        self,
        tokenizer: Any,
        template: ChatTemplate,
        *,
        train_on: str,
        columns: tuple[str, ...],
        name: str = "",
        section: str = "training",
    ) -> None:
        if not callable(getattr(tokenizer, "encode_with_offsets", None)):
            raise DataError(
                f"chat data needs a tokenizer that reads special-token names in text "
                f"(encode_with_offsets); {type(tokenizer).__name__} cannot. Use a tokenizer.json "
                "folder or a tiktoken file (model.tokenizer_path)."
            )
        self.tokenizer = tokenizer
        self.template = template
        self.train_on = train_on
        self.columns = columns
        self.name = name
        self.section = section

    def messages(self, row: Any, index: int) -> list[dict[str, Any]]:
        """The checked conversation of ``row``, ``None`` keys dropped (as transformers: parquet rows
        hold every struct field), reasoning under the names templates read."""
        where = f"row {index} of {self.name!r}"
        if isinstance(row, dict):  # the columns are there (a local file's reader checked them)
            row = chat_row(row, self.columns, self.section, where)
        if len(self.columns) == 2:
            prompt, response = (row.get(c) if isinstance(row, dict) else None for c in self.columns)
            if not isinstance(prompt, str) or not isinstance(response, str):
                raise DataError(
                    f"{where}: columns {list(self.columns)} hold {type(prompt).__name__} and "
                    f"{type(response).__name__}, not the prompt and response texts."
                )
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        value = _from_json(row.get(self.columns[0]) if isinstance(row, dict) else row)
        if not isinstance(value, list) or not value:
            raise DataError(
                f"{where}: column {self.columns[0]!r} holds {type(value).__name__}"
                f"{' (empty)' if value == [] else ''}, not a list of messages "
                "[{'role': ..., 'content': ...}, ...]. Set "
                f"{self.section}.messages_column to the column of the conversations."
            )
        out = []
        for k, message in enumerate(map(_from_json, value)):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise DataError(
                    f"{where}: message {k} is {message!r:.80}, not a mapping with a 'role' "
                    "and a 'content'."
                )
            message = {key: v for key, v in message.items() if v is not None}
            reasoning = next((message[key] for key in _REASONING if key in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            out.append(message)
        return out

    def encode(self, row: Any, index: int) -> tuple[list[int], list[bool]]:
        """The ids of row ``index`` and which of them are trained."""
        messages = self.messages(row, index)
        try:
            text = self.template.render(messages)
            spans = self._spans(messages, text, index) if self.train_on != "all" else []
        except DataError:
            raise
        except Exception as e:  # the template's own errors (raise_exception, a bad key)
            raise DataError(
                f"row {index} of {self.name!r}: the chat template ({self.template.origin}) "
                f"failed on it: {type(e).__name__}: {e}"
            ) from None
        ids, starts = self.tokenizer.encode_with_offsets(text)
        if self.train_on == "all":
            trained = [True] * len(ids)
        else:
            trained = [any(a <= s < b for a, b in spans) for s in starts]
        if not ids or ids[-1] != self.tokenizer.eos_id:
            ids.append(self.tokenizer.eos_id)
            trained.append(bool(trained) and trained[-1])
        return ids, trained

    def _spans(self, messages: list[dict], text: str, index: int) -> list[tuple[int, int]]:
        """``[start, end)`` in ``text`` of each trained assistant turn."""
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.train_on == "last_assistant":
            turns = turns[-1:]
        origin = self.template.origin
        return [
            assistant_span(
                self.template,
                messages,
                i,
                text,
                f"row {index} of {self.name!r}, assistant message {i} (chat template {origin})",
            )
            for i in turns
        ]


def _from_json(value: Any) -> Any:
    """``value``, or the list or object a JSON string holds (``datasets`` hands messages of
    differing fields over as JSON text)."""
    if isinstance(value, str) and value.lstrip().startswith(("[", "{")):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def assistant_span(
    template: ChatTemplate, messages: list[dict], i: int, text: str, where: str
) -> tuple[int, int]:
    """``[start, end)`` of assistant turn ``i`` in ``text`` (all ``messages`` rendered), found
    by rendering prefixes; ``DataError`` (starting with ``where``) when it cannot be."""
    before = template.render(messages[:i], add_generation_prompt=True)
    plain = template.render(messages[:i])
    if before == plain or not text.startswith(before):
        why = (
            "add_generation_prompt adds nothing before a reply"
            if before == plain
            else "the conversation does not begin with the prompt it writes for a reply"
        )
        raise DataError(
            f"{where}: the template does not mark assistant turns ({why}), so a reply's "
            "tokens cannot be told from the prompt's. Use a template with an assistant header "
            "(e.g. 'llama3', 'qwen3'), or train_on = 'all'."
        )
    start = len(before)
    through = template.render(messages[: i + 1])
    turn = through[start:] if through.startswith(before) else None
    if turn is not None and text.startswith(turn, start):
        end = start + len(turn)
    else:  # rendered otherwise as the last turn: follow its content to the same ending
        end = _end_after_content(turn or "", text, start, messages[i].get("content"))
        if end is None:
            raise DataError(
                f"{where}: the template renders the conversation so that this reply cannot be "
                "located (neither as rendered on its own nor by its content); use train_on = "
                "'all', or another template."
            )
    return start, start + len(text[start:end].rstrip())


def _end_after_content(turn: str, text: str, start: int, content: Any) -> int | None:
    """Where the turn ends in ``text``: after its content (from ``start``, stripped: templates
    may trim it in one place only) and what ``turn`` writes after it when rendered last."""
    if not isinstance(content, str) or not content.strip():
        return None
    content = content.strip()
    at = turn.rfind(content)
    found = text.find(content, start)
    if at < 0 or found < 0:
        return None
    tail = turn[at + len(content) :].lstrip()
    end = found + len(content)
    while end < len(text) and text[end].isspace():  # the content's own trailing space
        end += 1
    return end + len(tail) if text.startswith(tail, end) else None


def check_chat_template(template: ChatTemplate, train_on: str, key: str) -> None:
    """Before any work: a one-line ``DataError`` (naming ``key``) when the template fails on
    a probe conversation or, unless every token is trained, hides its assistant turns."""
    where = f"{key} ({template.origin}) with train_on={train_on!r}"
    try:
        text = template.render(_PROBE)
        if train_on != "all":
            for i in (1, 3):
                assistant_span(template, _PROBE, i, text, where)
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"{key} ({template.origin}) fails on a plain user/assistant conversation: "
            f"{type(e).__name__}: {e}"
        ) from None


def chat_row(
    row: dict[str, Any], columns: tuple[str, ...], section: str, where: str
) -> dict[str, Any]:
    """The chat ``columns`` of ``row`` (``where``: ``row 3 of 'data' (in f.jsonl)``), or a
    one-line ``DataError`` naming the row, the missing column, the row's and the key."""
    for k, column in enumerate(columns):
        if row.get(column) is None:
            key = ("prompt_column", "response_column")[k] if len(columns) > 1 else None
            what = "the conversations" if key is None else key.split("_")[0] + "s"
            missing = "a null" if column in row else "no column"
            raise DataError(
                f"{where} has {missing} {column!r}; its columns are {sorted(row)}. "
                f"Set {section}.{key or 'messages_column'} to the column of {what}, or fix it."
            )
    return {column: row[column] for column in columns}


def build_chat_encoder(source: DataSource, tokenizer: Any, *, name: str = "") -> ChatEncoder:
    """The encoder ``source``'s chat keys describe, its template checked."""
    key = f"{source.section}.chat_template"
    template = load_chat_template(source.chat_template, tokenizer, key=key)
    check_chat_template(template, source.train_on, key)
    return ChatEncoder(
        tokenizer,
        template,
        train_on=source.train_on,
        columns=source.chat_columns,
        name=name or source.dataset,
        section=source.section,
    )
