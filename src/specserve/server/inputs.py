"""From an API request to engine requests: tokenize (chat template for chat), check lengths,
build SamplingParams, fan out n choices. Runs before anything is queued, so every problem
reaches the client as a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass

from jinja2 import TemplateError

from specserve.core.errors import InvalidRequestError
from specserve.core.sampling_params import Grammar, SamplingParams, choice_seed
from specserve.runtime.grammar import GrammarCompiler
from specserve.runtime.schema_checks import TOO_DEEP, too_deep
from specserve.server.errors import APIError, bad_request, from_invalid_request, too_long
from specserve.server.grammar_compile import GrammarChecker
from specserve.server.messages import AddRequest, EngineInfo
from specserve.server.prompt_encoder import THREAD_CHARS, PromptEncoder
from specserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    ResponseFormat,
    SamplingFields,
)
from specserve.server.tools import call_grammar, tool_format

# A chat message's weight beside its text in the choice to render a conversation on a
# worker thread (THREAD_CHARS): its turn markers, roles and the template's loop over it.
MESSAGE_CHARS = 64
MAX_CHOICES = 1024  # engine requests one API request may fan out into (prompts x n)


@dataclass
class PreparedRequest:
    """Engine requests of one API request; choice i of prompt p is requests[p * n + i]."""

    request_id: str
    requests: list[AddRequest]
    num_prompt_tokens: int  # summed over distinct prompts (not over choices)


class InputProcessor:
    """Knows the tokenizer and the engine's limits; turns requests into AddRequests."""

    def __init__(self, tokenizer, info: EngineInfo):
        self.tokenizer = tokenizer
        self.encoder = PromptEncoder(tokenizer)
        self.info = info
        eos = list(info.eos_token_ids)  # (the engine's: it loads what is compiled here)
        if not eos and getattr(tokenizer, "eos_token_id", None) is not None:
            eos = [tokenizer.eos_token_id]  # (an EngineInfo that does not say)
        self.grammars = GrammarCompiler(tokenizer, info.vocab_size, eos)
        self.grammar_checker = GrammarChecker(self.grammars)
        template = getattr(tokenizer, "chat_template", None)
        self.tool_format = tool_format(template)
        # a template that names the developer role renders it; others get it as system
        self._template_knows_developer = "developer" in str(template or "")

    def close(self) -> None:
        """Stop the grammar compiles' workers (the server shuts down)."""
        self.grammar_checker.close()

    async def check_grammar(self, prepared: PreparedRequest) -> None:
        """Compile the request's grammar here, in worker processes and within a time bound,
        so that one the engine would refuse is a 4xx before any stream starts, and hand it
        to the engine compiled (server/grammar_compile.py)."""
        grammar = prepared.requests[0].params.grammar
        if grammar is not None:
            compiled = await self.grammar_checker.compiled(grammar)
            for request in prepared.requests:
                request.params.grammar = compiled

    # ---- prompts --------------------------------------------------------------------------
    async def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt; texts as LLMEngine.tokenize gives them (server and offline
        outputs agree), long ones encoded off the event loop (server/prompt_encoder.py)."""
        p = req.prompt
        if isinstance(p, str):
            self._check_text_length(p, "prompt")
            return await self.encoder.encode([p])
        if isinstance(p[0], str):
            for i, text in enumerate(p):
                self._check_text_length(text, f"prompt[{i}]")
            return await self.encoder.encode(list(p))
        if isinstance(p[0], int):
            return [list(p)]
        return [list(ids) for ids in p]

    def prompt_text(self, req: CompletionRequest, index: int, ids: list[int]) -> str:
        """Prompt `index` as echo returns it: the text sent, or token ids decoded."""
        p = req.prompt
        if isinstance(p, str):
            return p
        if isinstance(p[0], str):
            return p[index]
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    async def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            _check_message(m, i, req.messages[i - 1] if i else None)
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type != "text" or not hasattr(part, "text"):
                        raise bad_request(
                            f"content part type {part.type!r} is not supported; "
                            "only text parts are",
                            f"messages[{i}].content[{j}].type",
                        )
                    texts.append(part.text)
                content = "".join(texts)
            role = m.role
            if role == "developer" and not self._template_knows_developer:
                role = "system"  # (OpenAI's name for the system role of newer models)
            message = {"role": role, "content": content or ""}
            if m.tool_calls:
                message["tool_calls"] = [_template_call(c) for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        tools = None
        if req.tools and req.tool_choice != "none":
            self.tools_format_for(req)  # (a 400 when the template renders none)
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
        # (the template's work grows by the message too: 150k empty messages took 2.6 s
        # to render, on the loop while only their text counted)
        size = sum(len(m["content"]) for m in messages) + MESSAGE_CHARS * len(messages)
        try:
            if size > THREAD_CHARS:
                out = await asyncio.to_thread(self._apply_template, messages, tools)
            else:
                out = self._apply_template(messages, tools)
        except APIError:
            raise
        except TemplateError as e:  # the template's own checks (roles that must alternate...)
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from e
        except Exception as e:  # anything else: how it failed is not the client's business
            raise bad_request(
                "the chat template could not render these messages", "messages"
            ) from e
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return list(ids)

    def _apply_template(self, messages: list[dict], tools: list[dict] | None = None):
        """The chat's token ids: rendered, then tokenized without special tokens added, as
        apply_chat_template(tokenize=True) does (through the prompt encoder when it is fast)."""
        if not self.encoder.fast:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True
            )
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        self._check_text_length(text, "messages")
        return self.encoder.encode_many([text], add_special_tokens=False)[0] if text else []

    def _check_text_length(self, text: str, param: str) -> None:
        """A 400 for a text that has more tokens than the context holds, by a bound found
        without encoding it (PromptEncoder.fewest_tokens); texts it cannot tell pass."""
        fewest = self.encoder.fewest_tokens(text)
        if fewest >= self.info.max_model_len:
            raise too_long(
                f"This model's maximum context length is {self.info.max_model_len} tokens; "
                f"the prompt has at least {fewest} tokens ({len(text)} characters): shorten it",
                param,
            )

    def prompt_offsets(self, text: str, ids: list[int]) -> list[int] | None:
        """Each prompt token's character offset in `text` (echo's text_offset), from the
        tokenizer's own offsets where encoding the text gives these ids (with or without
        the special tokens it adds), else None: counted from the tokens then."""
        if self.tokenizer is None:
            return None
        for special in (True, False):
            try:
                enc = self.tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
            except Exception:  # (a slow tokenizer has no offsets)
                return None
            if list(enc["input_ids"]) == ids:
                return [start for start, _ in enc["offset_mapping"]]
        return None

    # ---- checks ---------------------------------------------------------------------------
    def check_prompt(self, ids: list[int], param: str = "prompt") -> None:
        info = self.info
        if not ids:
            raise bad_request("the prompt is empty; send at least one token", param)
        if max(ids) >= info.vocab_size:  # (max: a fifth of a generator's time on 2k tokens)
            bad = next(t for t in ids if t >= info.vocab_size)
            raise bad_request(
                f"token id {bad} is out of range; this model's ids lie in [0, {info.vocab_size})",
                param,
            )
        if len(ids) >= info.max_model_len:
            raise too_long(
                f"This model's maximum context length is {info.max_model_len} tokens; the "
                f"prompt has {len(ids)} tokens: shorten it",
                param,
            )

    def max_tokens(
        self, ids: list[int], asked: int | None, param: str, prompt_param: str = "prompt"
    ) -> int:
        """The request's max_tokens, checked against the context and the KV cache; when not
        given, whatever room the context leaves (errors about the prompt name
        `prompt_param`: chat's is messages)."""
        info = self.info
        limit = min(info.max_model_len, info.kv_capacity_tokens)
        if asked is None:
            if len(ids) >= limit:
                raise too_long(
                    f"This model's maximum context length is {limit} tokens on this server; "
                    f"the prompt has {len(ids)} tokens, leaving no room to generate: shorten it",
                    prompt_param,
                )
            return limit - len(ids)
        if len(ids) + asked > info.max_model_len:
            raise too_long(
                f"This model's maximum context length is {info.max_model_len} tokens; the "
                f"request asks for {len(ids) + asked} ({len(ids)} in the prompt, {asked} "
                f"for {param}): lower {param} or shorten the prompt",
                param,
            )
        if len(ids) >= info.kv_capacity_tokens:
            raise too_long(
                f"the prompt ({len(ids)} tokens) leaves no room to generate in the KV cache "
                f"the server has ({info.kv_capacity_tokens} tokens); shorten it",
                prompt_param,
            )
        if len(ids) + asked > info.kv_capacity_tokens:
            raise too_long(
                f"the prompt ({len(ids)} tokens) plus {param} ({asked}) needs more KV cache "
                f"than the server has ({info.kv_capacity_tokens} tokens); lower {param}",
                param,
            )
        return asked

    # ---- fan-out --------------------------------------------------------------------------
    def prepare(
        self,
        prefix: str,
        req: SamplingFields,
        prompts: list[list[int]],
        asked_max_tokens: int | None,
        max_tokens_param: str,
        logprobs: int | None,
        prompt_param: str = "prompt",
    ) -> PreparedRequest:
        check_unsupported(req)
        if len(prompts) * req.n > MAX_CHOICES:
            raise bad_request(
                f"{len(prompts)} prompts x n={req.n} asks for more than {MAX_CHOICES} choices",
                "n",
            )
        self._check_token_ids(req)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        grammar = self.grammar_of(req)
        requests = []
        for p, ids in enumerate(prompts):
            # (a list of prompts: the one at fault named by its index)
            named = f"{prompt_param}[{p}]" if len(prompts) > 1 else prompt_param
            self.check_prompt(ids, named)
            max_tokens = self.max_tokens(ids, asked_max_tokens, max_tokens_param, named)
            for i in range(req.n):
                choice = p * req.n + i
                # seeded by its index within its prompt: a prompt's choices never depend on
                # the other prompts of the request (as LLM.generate's)
                seed = None if req.seed is None else choice_seed(req.seed, i)
                params = self.sampling_params(
                    req, max_tokens, max_tokens_param, logprobs, seed, grammar
                )
                requests.append(AddRequest(f"{request_id}-{choice}", ids, params))
        return PreparedRequest(request_id, requests, sum(len(ids) for ids in prompts))

    def _check_token_ids(self, req: SamplingFields) -> None:
        """logit_bias's and stop_token_ids' ids lie in the vocabulary (a 400 now, not an
        error event after a streaming 200), and no logit_bias id comes twice ("5", "05")."""
        vocab = self.info.vocab_size
        seen: dict[int, str] = {}
        for key in req.logit_bias or ():
            if not (key.isascii() and key.isdigit()):
                raise bad_request(
                    f"logit_bias keys must be token ids (non-negative integers); got {key!r}",
                    "logit_bias",
                )
            digits = key.lstrip("0") or "0"  # (int() refuses more than 4300 digits)
            token = int(digits) if len(digits) <= 18 else vocab
            if token >= vocab:
                raise bad_request(
                    f"logit_bias token id {key} is out of range; this model's ids lie in "
                    f"[0, {vocab})",
                    "logit_bias",
                )
            if token in seen:
                raise bad_request(
                    f"logit_bias names token {token} twice ({seen[token]!r} and {key!r})",
                    "logit_bias",
                )
            seen[token] = key
        for token in req.stop_token_ids or ():
            if token >= vocab:
                raise bad_request(
                    f"stop_token_ids holds {token}, out of range; this model's ids lie in "
                    f"[0, {vocab})",
                    "stop_token_ids",
                )

    def grammar_of(self, req: SamplingFields) -> Grammar | None:
        """What the output must match: response_format's, or a tool call when tool_choice
        forces one (server/tools.py)."""
        choice = getattr(req, "tool_choice", None)
        if choice == "required" or isinstance(choice, NamedToolChoice):
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
            name = choice.function.name if isinstance(choice, NamedToolChoice) else None
            return call_grammar(tools, self.tools_format_for(req), name)
        return _grammar(req.response_format)

    def tools_format_for(self, req: ChatCompletionRequest) -> str:
        """The tool call format of this model (a 400 when its template renders no tools)."""
        if self.tool_format is None:
            raise bad_request(
                "this model's chat template does not render tools; send the request without tools",
                "tools",
            )
        return self.tool_format

    @staticmethod
    def sampling_params(
        req: SamplingFields, max_tokens: int, max_tokens_param: str, logprobs, seed, grammar
    ) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_k=req.top_k or 0,
                top_p=1.0 if req.top_p is None else req.top_p,
                min_p=req.min_p or 0.0,
                seed=seed,
                stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                logit_bias=_logit_bias(req.logit_bias),
                min_tokens=req.min_tokens or 0,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0,
                grammar=grammar,
                # completions' echo with logprobs: the prompt's tokens are rated too
                prompt_logprobs=logprobs if getattr(req, "echo", False) else None,
            )
        except InvalidRequestError as e:
            raise from_invalid_request(e, {"max_tokens": max_tokens_param}) from e


def _template_call(call) -> dict:
    """An assistant message's tool call as chat templates read it: arguments as a dict
    (the API sends a JSON string; templates print them as JSON)."""
    try:
        arguments = json.loads(call.function.arguments)
    except (ValueError, RecursionError):  # (nested past Python's limit: kept as text)
        arguments = call.function.arguments
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


def _grammar(fmt: ResponseFormat | None) -> Grammar | None:
    """response_format as the grammar the output must match (None: plain text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":  # a JSON object, as OpenAI's JSON mode
        return Grammar("json_schema", '{"type": "object"}', field="response_format")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request(
            "response_format of type json_schema needs json_schema.schema", "response_format"
        )
    schema = fmt.json_schema.schema_
    if too_deep(schema):  # (json.dumps would recurse past Python's limit: a 500)
        raise bad_request(TOO_DEEP, "response_format")
    return Grammar("json_schema", json.dumps(schema), field="response_format")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """The API's {"token id": bias} as {token id: bias} (keys checked: _check_token_ids)."""
    if not bias:
        return None
    return {int(key.lstrip("0") or "0"): float(value) for key, value in bias.items()}


def check_unsupported(req: SamplingFields) -> None:
    """Fields the API defines that specserve does not implement: only neutral values pass."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    forced = getattr(req, "tool_choice", None) not in (None, "none", "auto")
    fmt = req.response_format
    if req.ignore_eos and (forced or (fmt is not None and fmt.type != "text")):
        raise bad_request(
            "ignore_eos cannot be combined with response_format or a forced tool call: the "
            "output would go on, unconstrained, past the end of the format",
            "ignore_eos",
        )
    if isinstance(req, CompletionRequest):
        if req.max_tokens == 0 and not req.echo:
            raise bad_request(
                "max_tokens 0 generates nothing; it is for scoring a prompt, with echo true",
                "max_tokens",
            )
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (best-of ranking is not supported)", "best_of")
    if isinstance(req, ChatCompletionRequest):
        choice = req.tool_choice
        if choice not in (None, "none", "auto") and not req.tools:
            raise bad_request("tool_choice required or a function needs tools", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
            t.function.name for t in req.tools
        }:
            raise bad_request(
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                "tool_choice",
            )
        if choice not in (None, "none", "auto") and req.response_format is not None:
            raise bad_request(
                "response_format and a forced tool_choice cannot be combined", "response_format"
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        names = [t.function.name for t in req.tools or ()]
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise bad_request(f"two tools are named {twice!r}; tool names must differ", "tools")
        _check_chat_unsupported(req)


def _check_chat_unsupported(req: ChatCompletionRequest) -> None:
    """Chat fields the API defines that specserve does not implement: neutral values only."""
    if req.modalities is not None and req.modalities != ["text"]:
        raise bad_request(
            "only text output is supported: modalities must be ['text']", "modalities"
        )
    if req.audio is not None:
        raise bad_request("audio output is not supported", "audio")
    for name, neutral in (("functions", ([],)), ("function_call", ("none",))):
        if getattr(req, name) not in (None, *neutral):
            raise bad_request(
                f"{name} (the API's deprecated form of tools) is not supported; send tools "
                "and tool_choice",
                name,
            )
    if req.reasoning_effort is not None:
        raise bad_request(
            "reasoning_effort is not supported: this server's models do not reason apart",
            "reasoning_effort",
        )
    if req.best_of not in (None, 1):
        raise bad_request("best_of is not supported on chat completions", "best_of")
    if req.echo:
        raise bad_request("echo is not supported on chat completions; use /v1/completions", "echo")


def model_check(requested: str | None, served: list[str]) -> str:
    """The served name to report; 404 for a model this server does not serve."""
    if requested is None or requested in served:
        return requested or served[0]
    raise APIError(
        404,
        f"the model {requested!r} does not exist; this server serves {served[0]!r}",
        param="model",
        code="model_not_found",
    )


def _check_message(m, i: int, before) -> None:
    """A 400 for a message the API refuses (OpenAI's rules): content missing where its role
    needs it (every role but an assistant's turn that calls tools), a tool result without
    the call's id or not after a turn that called tools (or another result)."""
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        need = "content or tool_calls" if m.role == "assistant" else "content"
        raise bad_request(f"a message of role {m.role!r} needs {need}", f"messages[{i}].content")
    if m.role != "tool":
        return
    if not m.tool_call_id:
        raise bad_request(
            "a message of role 'tool' needs the tool_call_id of the call it answers",
            f"messages[{i}].tool_call_id",
        )
    if before is None or not (
        before.role == "tool" or (before.role == "assistant" and before.tool_calls)
    ):
        raise bad_request(
            "a message of role 'tool' must answer a preceding assistant message with tool_calls",
            f"messages[{i}].role",
        )
