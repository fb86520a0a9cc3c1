"""Request bodies of the HTTP server. Types are strict: ``"8"``, ``8.0`` or ``true`` where an integer belongs is
a 400 naming the field, never coerced (an integer is a valid float).

The OpenAI routes take what real clients send, as vLLM and SGLang do: a field this server does not know is
ignored (logged once per name at debug level), and ``null`` means "the default" wherever OpenAI allows it. The
native ``/generate`` keeps refusing unknown fields."""

import logging
from typing import Any, Dict, List, Optional, Set, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lightllm.engine.sampler import MAX_PENALTY, MAX_SEED, MAX_TOP_LOGPROBS

logger = logging.getLogger(__name__)

MAX_N = 128  # n and best_of: each is a request of its own in the engine
# Unknown field names logged so far: bounded, as clients choose the names (a set of every one grew without limit).
_ignored_logged: Set[str] = set()
MAX_IGNORED_LOGGED = 256
_NAME_SHOWN = 64  # characters of an unknown name that are logged


# NaN and infinity (Python's JSON parser reads them) are refused by name rather than by whichever bound they fail.
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Lenient(BaseModel):
    """Unknown fields are accepted and dropped; the first time a name is seen it is logged (the first 256 names)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _log_ignored(self):
        for name in self.model_extra or {}:
            key = f"{type(self).__name__}.{name[:_NAME_SHOWN]}"
            if key not in _ignored_logged and len(_ignored_logged) < MAX_IGNORED_LOGGED:
                _ignored_logged.add(key)
                logger.debug("%s: field %r is not used by this server; ignored", type(self).__name__,
                             name[:_NAME_SHOWN])  # fmt: skip
        return self


class _Sampling(_Body):
    """Fields every endpoint shares; OpenAI's endpoints default to temperature 1, the native one to greedy."""

    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: Optional[int] = Field(None, ge=0, lt=MAX_SEED)
    stop: Union[str, List[str], None] = None


class GenerateParameters(_Sampling):
    """LightLLM's ``parameters``: ``do_sample`` false is greedy whatever the temperature; true samples at
    ``temperature`` (default 1); left out, ``temperature`` decides (default 0: greedy)."""

    max_new_tokens: int = Field(16, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_k: int = Field(0, ge=-1)  # -1 or 0: off (LightLLM's default is -1)
    do_sample: Optional[bool] = None
    stop_sequences: Union[str, List[str], None] = None  # LightLLM's name; joined with ``stop``
    logprobs: bool = False
    return_details: bool = False
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(1.0, gt=0)
    min_new_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    add_special_tokens: bool = True  # a text input's BOS and the like (LightLLM's benchmark client sends false)


class GenerateRequest(_Body):
    inputs: Union[str, List[int]]
    parameters: GenerateParameters = GenerateParameters()


class StreamOptions(_Lenient):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None  # vLLM's: with include_usage, each chunk has its choice's usage


class ResponseFormat(_Lenient):
    type: str


class _OpenAI(_Lenient):
    """Sampling fields of both OpenAI routes; None: the model's generation_config.json value, else OpenAI's."""

    model: Optional[str] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(None, ge=1, le=MAX_N)
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)  # -1 or 0: off (vLLM's and SGLang's -1 too)
    min_p: Optional[float] = Field(None, ge=0, le=1)  # vLLM's and SGLang's extension; 0: off
    seed: Optional[int] = Field(None, ge=0, lt=MAX_SEED)
    stop: Union[str, List[str], None] = None
    stop_token_ids: Optional[List[int]] = None
    presence_penalty: Optional[float] = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: Optional[float] = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    logit_bias: Optional[Dict[str, float]] = None  # keys: token ids as strings (JSON object keys)
    min_tokens: Optional[int] = Field(None, ge=0)
    ignore_eos: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None
    user: Optional[str] = None
    skip_special_tokens: Optional[bool] = None  # vLLM's: false keeps special tokens' text in the text
    include_stop_str_in_output: Optional[bool] = None  # vLLM's: the text ends with the stop string or stop token
    truncate_prompt_tokens: Optional[int] = Field(None, ge=1)  # vLLM's: only the prompt's last this many tokens


class CompletionRequest(_OpenAI):
    prompt: Union[str, List[int], List[Union[str, List[int]]]]  # a list: one choice (or n) per prompt
    max_tokens: Optional[int] = Field(16, ge=1)  # null: the rest of max_req_total_len
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Optional[bool] = None
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    suffix: Optional[str] = None


class ContentPart(_Lenient):
    type: str
    text: Optional[str] = None


class ChatMessage(_Lenient):
    role: str
    content: Union[str, List[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None  # an earlier answer's reasoning (Qwen3's template reads it)


class ChatRequest(_OpenAI):
    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    add_generation_prompt: Optional[bool] = None  # vLLM's: the template opens the answer (default true)
    continue_final_message: Optional[bool] = None  # vLLM's: the answer continues the last (assistant) message
