"""Chat requests to token ids: the checkpoint's chat template rendered with ``jinja2`` the way
``transformers``' ``apply_chat_template`` renders it, then encoded without adding special tokens
again (the template writes ``bos_token`` itself where the model wants one).

The environment matches ``transformers``': an ``ImmutableSandboxedEnvironment`` (templates from
a hub are untrusted code) with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``{% generation %}`` block tag (rendered as its body), a ``tojson`` filter that does
not HTML-escape, and the globals ``raise_exception(message)`` and ``strftime_now(format)``. The
template sees ``messages`` (dicts with ``role``, ``content`` and, when given, ``name`` /
``tool_call_id``), ``add_generation_prompt``, and the ``bos_token`` / ``eos_token`` strings.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Optional

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedspec.serve.protocol import ChatMessage, RequestError


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it (to
    build training masks); rendering a prompt only needs the body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached by source). Raises ``jinja2.TemplateSyntaxError``."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def special_tokens(checkpoint, tokenizer) -> tuple[Optional[str], Optional[str]]:
    """``(bos_token, eos_token)`` strings as ``transformers`` passes them to a template: those
    of the directory's ``tokenizer_config.json`` (a string or ``{"content": ...}``), else the
    text of the checkpoint's bos / first eos token id (GGUF files)."""
    names: dict = {}
    path = Path(str(getattr(checkpoint, "path", "")))
    config_file = path / "tokenizer_config.json" if path.is_dir() else None
    if config_file is not None and config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError:
            config = {}
        for key in ("bos_token", "eos_token"):
            value = config.get(key) if isinstance(config, dict) else None
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                names[key] = value

    def token_text(token_id) -> Optional[str]:
        if tokenizer is None or token_id is None:
            return None
        return tokenizer.id_to_token(int(token_id))

    generation = getattr(checkpoint, "generation", None)
    eos_ids = tuple(getattr(generation, "eos_token_ids", ()) or ())
    bos = names.get("bos_token") or token_text(getattr(generation, "bos_token_id", None))
    eos = names.get("eos_token") or token_text(eos_ids[0] if eos_ids else None)
    return bos, eos


class ChatRenderer:
    """Renders chat messages with one template and encodes them for the engine.

    Args:
        template: the chat template source, or None (every request then gets a 400 saying the
            checkpoint has no chat template).
        tokenizer: a ``tokenizers.Tokenizer`` (None: chat is refused, as there is no text).
        bos_token, eos_token: the strings the template may write (None: empty strings).
        model_path: named in the no-template message.
    """

    def __init__(self, template: Optional[str], tokenizer, bos_token: Optional[str],
                 eos_token: Optional[str], model_path: str = "the model"):
        self.template_source = template
        self.tokenizer = tokenizer
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""
        self.model_path = model_path
        self._compiled: Optional[jinja2.Template] = None
        self._syntax_error: Optional[str] = None
        if template is not None:
            try:
                self._compiled = compile_template(template)
            except jinja2.TemplateSyntaxError as exc:
                self._syntax_error = f"line {exc.lineno}: {exc.message}"

    @classmethod
    def for_engine(cls, engine) -> "ChatRenderer":
        """The renderer of an :class:`~pagedspec.engine.engine.Engine`'s checkpoint (its
        ``chat_template``, which the loader reads from ``chat_template.jinja``,
        ``tokenizer_config.json`` or a GGUF file)."""
        checkpoint, tokenizer = engine.checkpoint, engine.tokenizer
        bos, eos = special_tokens(checkpoint, tokenizer)
        return cls(getattr(checkpoint, "chat_template", None), tokenizer, bos, eos,
                   str(getattr(checkpoint, "path", "the model")))

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text. Raises RequestError (400) when the checkpoint has no usable template
        or the template refuses the messages (``raise_exception``, e.g. roles that must
        alternate)."""
        if self.template_source is None:
            raise RequestError(f"{self.model_path} has no chat template (no chat_template.jinja, "
                               "no chat_template in tokenizer_config.json or in the GGUF file), "
                               "so chat requests cannot be rendered; use /v1/completions with "
                               "a prompt you format yourself", param="messages")
        if self._compiled is None:
            raise RequestError(f"the chat template of {self.model_path} cannot be parsed "
                               f"({self._syntax_error}); use /v1/completions", param="messages")
        plain = []
        for message in messages:
            entry = {"role": message.role, "content": message.text()}
            if message.name is not None:
                entry["name"] = message.name
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            plain.append(entry)
        try:
            return self._compiled.render(messages=plain,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.TemplateError as exc:
            raise RequestError(f"the chat template rejected the messages: {exc}",
                               param="messages") from None

    def encode(self, messages: list[ChatMessage], add_generation_prompt: bool = True
               ) -> list[int]:
        """Token ids of the rendered prompt (special tokens only where the template wrote
        them). Raises RequestError like :meth:`render`, and when there is no tokenizer."""
        text = self.render(messages, add_generation_prompt)
        if self.tokenizer is None:
            raise RequestError("the server runs without a tokenizer (--skip-tokenizer-init), so "
                               "chat messages cannot be encoded", param="messages")
        return self.tokenizer.encode(text, add_special_tokens=False).ids
