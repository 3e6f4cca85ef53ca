"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests are validated here for types and ranges (a failure becomes a 400 naming the field),
strictly: a string is not a number, a boolean not an integer ("max_tokens": "4" or a token id
true is a 400, not coerced); what needs the model (prompt length, token ids) is checked in
server/inputs.py. Fields the
API defines but specserve does not implement are accepted at their neutral value and
rejected otherwise, so a request never silently means something else. Unknown fields are
ignored, like other OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)


def _unicode(text: str) -> str:
    """Text the tokenizer can take: JSON's \\ud800-style escapes can carry a lone UTF-16
    surrogate, which is no character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"holds an unpaired surrogate (U+{ord(text[e.start]):04X}) at "
            f"character {e.start}; send valid Unicode text"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**64)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
StopStr = Annotated[Text, Field(min_length=1, max_length=1000)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_defaults(cls, data: Any) -> Any:
        """An explicit null is the field's default, as OpenAI's API defines its nullable
        fields ("n": null is n 1, "stream": null no stream, completions' "max_tokens": null
        16): clients and proxies that send every field, unset ones as null, must work."""
        if isinstance(data, dict) and None in data.values():
            fields = cls.model_fields
            nulls = [
                key
                for key, value in data.items()
                if value is None
                and key in fields
                and fields[key].default is not None
                and not fields[key].is_required()  # (a required field's null is an error)
            ]
            if nulls:
                data = {key: value for key, value in data.items() if key not in nulls}
        return data


class StreamOptions(_Strict):
    """stream_options: include a final usage chunk when streaming."""

    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """response_format.json_schema: the schema the output must follow (`strict` is accepted
    and changes nothing: the output always follows it)."""

    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """response_format: text (no constraint), json_object (a JSON object) or json_schema
    (output matching the schema: runtime/grammar.py)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: Int64 | None = None
    stop: StopStr | Annotated[list[StopStr], Field(max_length=16)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    min_tokens: int | None = Field(None, ge=0)  # (vLLM's extension: EOS masked until then)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)  # (vLLM's extension)
    response_format: ResponseFormat | None = None
    user: str | None = None


def _prompt_count(value: Any) -> Any:
    """Too many prompts is said as such (not as the first string that is no token id)."""
    if isinstance(value, list) and len(value) > MAX_PROMPTS and isinstance(value[0], str | list):
        raise ValueError(f"holds {len(value)} prompts; send at most {MAX_PROMPTS} a request")
    return value


MAX_PROMPTS = 1024


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Annotated[
        Annotated[Text, Field(max_length=10_000_000)]
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]],
            Field(min_length=1, max_length=MAX_PROMPTS),
        ],
        BeforeValidator(_prompt_count),
    ]
    max_tokens: int | None = Field(16, ge=0)  # 0: with echo, score the prompt only
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None


class TextPart(_Strict):
    """A text part of a message's content."""

    type: Literal["text"]
    text: Text


class OtherPart(BaseModel):
    """Any non-text content part (images, audio...): parsed so the error can name it."""

    model_config = ConfigDict(extra="allow")
    type: str

    @model_validator(mode="after")
    def _not_text(self) -> OtherPart:
        if self.type == "text":  # (a text part that is no TextPart: TextPart's error says why)
            raise ValueError("a text part needs its text as a string")
        return self


class FunctionCall(_Strict):
    """A call the assistant made: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(_Strict):
    """One tool call of an assistant message."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """One message of the conversation (a tool's result: role tool with tool_call_id)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart | OtherPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Strict):
    """A function the model may call: its name, what it does, its parameters' JSON schema."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    """tools[i]: a function tool."""

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """tool_choice naming the function to call."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # defined by the API, not implemented: neutral values only (check_unsupported)
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # completions' fields some clients send to chat too: neutral values only
    best_of: int | None = None
    echo: bool | None = None


# ---- responses (documentation of the shapes; built as dicts in openai_format.py) ----------
class PromptTokensDetails(BaseModel):
    """Where the prompt tokens came from."""

    cached_tokens: int  # found in the prefix cache: not computed again


class Usage(BaseModel):
    """Token counts of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token (with `echo`, the
    prompt's tokens first, whose first has no logprob and no alternatives: null, as
    OpenAI's)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """One choice of a completion."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Response of POST /v1/completions (also the shape of each streamed chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    """An alternative token at one position."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """The chosen token at one position and its alternatives."""

    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """Chat logprobs of one choice."""

    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    """The generated message."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    """Response of POST /v1/chat/completions with stream false."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """What a streamed chat chunk adds to its choice's message."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of POST /v1/chat/completions with stream true (the last one,
    with stream_options.include_usage, has no choices and the usage)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    """Response of GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    """The error object of every non-2xx response."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Body of every non-2xx response."""

    error: ErrorBody
