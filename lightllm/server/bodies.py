"""Request bodies of the HTTP server. Unknown fields are errors and types are strict: ``"8"``, ``8.0`` or
``true`` where an integer belongs is a 400 naming the field, never coerced (an integer is a valid float)."""

from typing import List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from lightllm.engine.sampler import MAX_SEED


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Sampling(_Body):
    """Fields every endpoint shares; OpenAI's endpoints default to temperature 1, the native one to greedy."""

    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: Optional[int] = Field(None, ge=0, lt=MAX_SEED)
    stop: Union[str, List[str], None] = None


class GenerateParameters(_Sampling):
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0, le=100)
    logprobs: bool = False
    ignore_eos: bool = False


class GenerateRequest(_Body):
    inputs: Union[str, List[int]]
    parameters: GenerateParameters = GenerateParameters()


class _OpenAI(_Sampling):
    model: Optional[str] = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)
    user: Optional[str] = None


class CompletionRequest(_OpenAI):
    prompt: Union[str, List[int]]
    max_tokens: int = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=0)  # only the chosen token's logprob is returned


class ChatMessage(_Body):
    role: str
    content: str


class ChatRequest(_OpenAI):
    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
