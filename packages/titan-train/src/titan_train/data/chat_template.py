"""Chat templates: where a run's template comes from, and rendering it as transformers does
(its Jinja options and the tokenizer's special-token names), so the text tokenized with
special tokens recognized is what ``apply_chat_template`` gives. A template is untrusted
code: it runs in Jinja's immutable sandbox, which refuses attribute access beyond plain data.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

from titan_train.errors import DataError

__all__ = ["BUILTIN_TEMPLATES", "ChatTemplate", "load_chat_template"]

_LLAMA3 = (
    "{{- bos_token -}}\n"
    "{%- for message in messages -%}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}\n"
    "{{- message['content'] | trim -}}\n"
    "{{- '<|eot_id|>' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "{%- endif -%}\n"
)
# Qwen3 writes a <think> block into an assistant turn that follows the last user message when
# it is the conversation's last turn or carries reasoning: empty unless ``reasoning_content``.
_QWEN3 = (
    "{%- set ns = namespace(last_user=-1) -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- for message in messages -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}\n"
    "{%- set reasoning = (message.get('reasoning_content') or '') | trim -%}\n"
    "{%- if message['role'] == 'assistant' and loop.index0 > ns.last_user"
    " and (loop.last or reasoning) -%}\n"
    "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' + message['content'] | trim -}}\n"
    "{%- else -%}\n"
    "{{- message['content'] -}}\n"
    "{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}\n"
)

BUILTIN_TEMPLATES = {"llama3": _LLAMA3, "qwen3": _QWEN3}
"""Templates by name: ``llama3`` (Llama 3's header / ``<|eot_id|>`` turns after the BOS) and
``qwen3`` (Qwen3's ChatML turns, ``<|im_start|>`` / ``<|im_end|>``, with its ``<think>``
block in a final assistant turn); neither writes tools or a default system prompt."""

_SPECIAL_KEYS = ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplate:
    """A chat template ready to render: the Jinja ``source``, its ``origin`` (errors name
    it) and ``variables`` (the special tokens' names, as transformers passes them)."""

    def __init__(self, source: str, *, origin: str, variables: dict[str, str]) -> None:
        self.source = source
        self.origin = origin
        self.variables = dict(variables)
        try:
            self._template = _environment().from_string(source)
        except Exception as e:  # jinja2's TemplateSyntaxError and friends
            raise DataError(f"the chat template ({origin}) does not compile: {e}") from None

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
        """The text of ``messages``; jinja2's errors (and ``raise_exception``) propagate."""
        return self._template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.variables,
        )


def load_chat_template(name: str | None, tokenizer: Any, *, key: str) -> ChatTemplate:
    """The template ``name`` means: ``None`` the tokenizer folder's (``chat_template.jinja``,
    else ``tokenizer_config.json``'s), a built-in, or a Jinja file; ``key`` for errors."""
    folder = _tokenizer_folder(tokenizer)
    config = _tokenizer_config(folder) if folder else {}
    variables = _special_names(tokenizer, config)
    if name is None:
        source, origin = _folder_template(folder, config)
        if source is None:
            raise DataError(
                f"{key} is not set and the tokenizer ({folder or 'titan-train’s shipped one'}) "
                "has no chat template (no chat_template.jinja, no chat_template in "
                f"tokenizer_config.json). Set {key} to a built-in "
                f"({', '.join(BUILTIN_TEMPLATES)}) or a .jinja file, or model.tokenizer_path to "
                "a tokenizer folder with a template (e.g. 'embedded_chat')."
            )
        return ChatTemplate(source, origin=origin, variables=variables)
    if name in BUILTIN_TEMPLATES:
        return ChatTemplate(BUILTIN_TEMPLATES[name], origin=f"built-in {name}", variables=variables)
    path = os.path.expanduser(name)
    if not os.path.isfile(path):
        raise DataError(
            f"{key}={name!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
            "nor an existing file; give one of those, a path to a .jinja file, or leave it "
            "empty for the tokenizer folder's template."
        )
    with open(path, encoding="utf-8") as f:
        return ChatTemplate(f.read(), origin=path, variables=variables)


def _tokenizer_folder(tokenizer: Any) -> str | None:
    """The folder the tokenizer's file is in (Llama 3's ``original/`` one up)."""
    path = getattr(tokenizer, "path", None)
    if not path:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.basename(folder) == "original":
        folder = os.path.dirname(folder)
    return folder


def _tokenizer_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON: {e}") from None
    return config if isinstance(config, dict) else {}


def _folder_template(folder: str | None, config: dict[str, Any]) -> tuple[str | None, str]:
    """The template of a tokenizer folder, as transformers reads it: ``chat_template.jinja``
    first, then ``tokenizer_config.json``'s ``chat_template``."""
    if folder is None:
        return None, ""
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read(), jinja
    origin = os.path.join(folder, "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        origin += " (its 'default' template)"
    return (template, origin) if isinstance(template, str) else (None, origin)


def _special_names(tokenizer: Any, config: dict[str, Any]) -> dict[str, str]:
    """``bos_token`` and ``eos_token`` (the tokenizer's), and the config's other special
    tokens: the variables transformers hands a template."""
    names: dict[str, str] = {}
    for key in _SPECIAL_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            names[key] = value
    names["bos_token"] = tokenizer.decode([tokenizer.bos_id])
    names["eos_token"] = tokenizer.decode([tokenizer.eos_id])
    return names


@lru_cache(maxsize=1)
def _environment() -> Any:
    """Jinja's immutable sandbox with the options and helpers transformers gives templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with
        it; the body renders as is (assistant turns are found by rendering prefixes)."""

        tags = {"generation"}  # noqa: RUF012 (jinja2's own class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, **kwargs: Any) -> str:
        # Jinja's own tojson escapes HTML characters, which a prompt must keep.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
