"""Request and response bodies of the OpenAI-compatible server, in OpenAI's shapes.

Requests: :class:`CompletionRequest` (``POST /v1/completions``) and :class:`ChatCompletionRequest`
(``POST /v1/chat/completions``), with OpenAI's sampling fields and vLLM's extensions that
pagedspec implements (``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``).

Unknown fields are rejected (HTTP 400, "Unrecognized request argument supplied: <name>"), as
OpenAI's API does. vLLM instead accepts them and only logs a warning (its ``OpenAIBaseModel`` has
``extra="allow"`` and a validator that logs "The following fields were present in the request
but ignored"); we follow OpenAI because a silently ignored field is usually a misspelled one
(``max_token``) whose user then gets something they did not ask for.

Fields OpenAI or vLLM define but pagedspec does not implement (``echo``, ``suffix``, ``best_of``,
penalties, ``logit_bias``, tools, ``response_format``, ...) are accepted only at their neutral
value (absent, null, or the value that changes nothing, e.g. ``presence_penalty: 0``); any other
value gets a 400 naming the field, never a silently different result
(:meth:`_OpenAIModel.check_unimplemented`).
"""
from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

# OpenAI's limits: n <= 128 completions per prompt, top_logprobs <= 20 (completions' logprobs is 5
# there; vLLM's default max_logprobs is 20 for both, which we follow).
MAX_N = 128
MAX_LOGPROBS = 20


class RequestError(ValueError):
    """A request the server refuses; becomes an OpenAI-style error body.

    Args:
        message: what is wrong, naming the parameter and the value given.
        param: the request field at fault (None when no single field is).
        status_code: the HTTP status (400 bad request, 404 unknown model, 503 overloaded).
        type: OpenAI's error type string; code: OpenAI's machine-readable code (or None).
    """

    def __init__(self, message: str, param: Optional[str] = None, status_code: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status_code = message, param, status_code
        self.type, self.code = type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _OpenAIModel(BaseModel):
    # extra="forbid": unknown fields are a 400 (see the module docstring)
    model_config = ConfigDict(extra="forbid")

    # field name -> the values that change nothing (accepted and ignored)
    NEUTRAL: ClassVar[dict[str, tuple]] = {}

    def check_unimplemented(self) -> None:
        """Raises RequestError for a field pagedspec does not implement set to a value that
        would change the result."""
        for name, neutral in self.NEUTRAL.items():
            value = getattr(self, name)
            if value is not None and value not in neutral:
                raise RequestError(f"{name}={value!r} is not supported by pagedspec (accepted "
                                   f"only as {' or '.join(repr(v) for v in neutral) or 'null'} "
                                   "or absent)", param=name)


class StreamOptions(_OpenAIModel):
    include_usage: Optional[bool] = False


StopField = Union[str, list[str], None]


class _SamplingFields(_OpenAIModel):
    """The fields both endpoints share."""
    model: Optional[str] = None          # None: the served model (as vLLM allows)
    temperature: Optional[float] = None  # None: 1.0, OpenAI's default
    top_p: Optional[float] = None
    n: Optional[int] = Field(default=1, ge=1, le=MAX_N)
    stop: StopField = None
    seed: Optional[int] = Field(default=None, ge=-(2 ** 63), le=2 ** 63 - 1)   # int64
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None           # OpenAI's end-user tag: accepted, not used
    # vLLM's extensions
    top_k: Optional[int] = None          # None, 0 or -1: off
    min_p: Optional[float] = None
    ignore_eos: Optional[bool] = False
    stop_token_ids: Optional[list[int]] = None
    # defined by OpenAI / vLLM, not implemented: neutral values only
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    min_tokens: Optional[int] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    NEUTRAL: ClassVar[dict[str, tuple]] = {
        "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "repetition_penalty": (1.0,),
        "logit_bias": ({},), "min_tokens": (0,), "include_stop_str_in_output": (False,),
        "skip_special_tokens": (True,)}

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        if value is None:
            return value
        items = [value] if isinstance(value, str) else value
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        return value

    @property
    def stop_list(self) -> Optional[list[str]]:
        if self.stop is None or self.stop == []:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check(self) -> None:
        """Request-level rules pydantic's field types cannot express (RequestError)."""
        self.check_unimplemented()
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true",
                               param="stream_options")


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: a prompt (text, token ids, or a list of either) to continue."""
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(default=16, ge=1)   # OpenAI's default for completions
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    NEUTRAL: ClassVar[dict[str, tuple]] = {**_SamplingFields.NEUTRAL, "echo": (False,),
                                           "suffix": ("",)}

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise RequestError(f"best_of={self.best_of!r} is not supported by pagedspec "
                               "(accepted only equal to n, or absent)", param="best_of")

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts as a list of texts or token-id lists (RequestError if empty)."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif p and all(isinstance(t, int) for t in p):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise RequestError("prompt must be a non-empty string, token-id list, or list of "
                               "them", param="prompt")
        return prompts


class TextPart(_OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(_OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # a string, or content parts; only text parts are implemented (others fail validation,
    # naming messages.<i>.content)
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value):
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"only text content parts are supported, got a part of "
                                     f"type {kind!r}")
        return value

    def text(self) -> Optional[str]:
        """The content as one string (text parts joined by newlines, as vLLM's "string" content
        format does), or None."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: messages rendered by the checkpoint's chat template."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)          # deprecated by OpenAI
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's extension: False continues the last message instead of opening a new one
    add_generation_prompt: Optional[bool] = True
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    NEUTRAL: ClassVar[dict[str, tuple]] = {
        **_SamplingFields.NEUTRAL, "tools": ([],), "tool_choice": ("none",), "functions": ([],),
        "function_call": ("none",), "response_format": ({"type": "text"},)}

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", param="top_logprobs")

    @property
    def max_new_tokens(self) -> Optional[int]:
        """max_completion_tokens, else max_tokens, else None (the rest of the context)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None \
            else "max_tokens"


# ---- responses ---------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per generated token."""
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None   # vLLM's extension: the stop token or string


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagedspec"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def sse(payload: Union[BaseModel, dict], *, include_usage: bool = True) -> str:
    """One server-sent event ``data: {json}\\n\\n``; a model's ``usage`` key is left out when
    the client did not ask for usage in its stream (``include_usage`` False), as OpenAI does."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude={"usage"} if not include_usage else None)
    else:
        import json
        text = json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"
