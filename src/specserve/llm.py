"""The offline API: `LLM(model).generate(prompts, params)` continues text as given;
`LLM.chat(messages, params)` answers a conversation through the model's chat template."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from jinja2 import TemplateError
from tqdm import tqdm

from specserve.core.config import EngineConfig
from specserve.core.errors import InvalidRequestError
from specserve.core.request import SpecStats
from specserve.core.sampling_params import SamplingParams, choice_seed
from specserve.engine.engine import LLMEngine
from specserve.engine.outputs import RequestOutput
from specserve.model.loader import tools_template
from specserve.runtime.sampled_tokens import TokenLogprobs

Prompt = str | list[int]
Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": text}


@dataclass
class CompletionOutput:
    """One finished generation.

    `text` and `token_ids` are what was generated (a stop string is cut off the text);
    `finish_reason` is "stop" (end of sequence, stop string or stop token), "length"
    (max_tokens or the context) or "abort". `logprobs` is None unless the request's
    SamplingParams asked for them (`logprobs=k`): then one TokenLogprobs per token of
    `token_ids`, each with the token's log-probability (`.logprob`) and the k likeliest
    tokens as (token id, log-probability) pairs (`.top`), under the model's own distribution
    (before temperature and filters).
    """

    request_id: str
    prompt: str | None  # the prompt's text when it was given as text
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    spec_stats: SpecStats | None = None  # drafted / accepted counts when speculating
    logprobs: list[TokenLogprobs] | None = None
    # With prompt_logprobs=k: per prompt token (None for the first, which nothing rates)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class LLM:
    """Generate text with a local model, in this process.

    `model`: a Hugging Face model folder or .gguf file (default: the embedded
    SmolLM2-135M-Instruct); other keyword arguments are the engine's options by their flat
    names (`EngineConfig.from_flags`), as the flags of `specserve generate`
    (`dtype="float32"`, `speculative_algorithm="ngram"`, ...).
    `progress=True` reports the start-up phases and their timings on stderr.

        from specserve import LLM, SamplingParams
        llm = LLM()
        print(llm.chat([{"role": "user", "content": "Tell me a joke."}])[0].text)
        outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))

    SamplingParams() is greedy with at most 128 new tokens, as `specserve generate`.
    """

    def __init__(self, model: str | None = None, progress: bool = False, **engine_kwargs):
        config = EngineConfig.from_flags(model=model, **engine_kwargs)  # TypeError: unknown
        self.engine = LLMEngine(config, progress=progress)
        self.tokenizer = self.engine.tokenizer
        # request id -> outputs not yet taken by the generate or stream call it belongs to
        self._boxes: dict[str, list[RequestOutput]] = {}

    def close(self) -> None:
        """Stop what the engine started beyond this process (the other ranks under tensor
        parallelism); the LLM is unusable afterwards. `with LLM(...) as llm:` calls it."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        """Token ids of a conversation through the model's chat template, ready for the
        assistant's reply (as the server's /v1/chat/completions builds them); OpenAI-style
        content parts as their texts joined, as the server takes them. `tools` and
        `chat_template_kwargs` go to the template, as transformers' (and vLLM's) take them."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "this model has no chat template; send the prompt to generate() instead "
                "(as text, or as token ids where the engine has no tokenizer)",
                "messages",
            )
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("a conversation needs at least one message", "messages")
        if tools and tools_template(self.tokenizer.chat_template) is None:
            raise InvalidRequestError(
                "this model's chat template does not render tools; send the conversation "
                "without tools",
                "tools",
            )
        kwargs = _template_kwargs(chat_template_kwargs)
        try:
            out = self.tokenizer.apply_chat_template(
                [_message(m, i) for i, m in enumerate(messages)],
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                tools=tools,
                **kwargs,
            )
        except TemplateError as e:  # the template's own checks (roles that must alternate...)
            raise InvalidRequestError(
                f"the chat template rejected the messages: {e}", "messages"
            ) from e
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """Continue each prompt as it is, all batched together; outputs keep prompt order.

        A prompt is text (tokenized with the tokenizer's special tokens, such as a BOS, but
        no chat template) or token ids: this is a completion, as the server's
        /v1/completions. An instruct model answers questions through `chat`, which is what
        `specserve generate` does unless told --no-chat-template. `params`: one
        SamplingParams for every prompt, or one per prompt (default: greedy, 128 tokens). A
        prompt whose params ask for n choices gives n outputs in a row (seeded ones each get
        `choice_seed(seed, its index among the prompt's choices)`, as the server's choices:
        never of where the prompt stands in the batch).

            outs = llm.generate(["1, 2, 3,", "The capital of France is"],
                                SamplingParams(max_tokens=8))
            print(outs[0].text, outs[0].token_ids, outs[0].finish_reason)
        """
        prompts = _as_prompt(prompts)  # (an array of ids: a list of them, or of prompts)
        if isinstance(prompts, str) or (
            len(prompts) > 0 and isinstance(prompts[0], numbers.Number)
        ):
            prompts = [prompts]  # (one prompt of token ids, numpy's too; floats are refused)
        prompts = [_as_prompt(p) for p in prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        for p in {id(p): p for p in params}.values():  # (changed since construction: n
            p.validate()  # fans out here, before the engine checks each choice)
        choices = []  # (prompt, one choice's params), seeded by its index in its prompt
        for prompt, p in zip(prompts, params):
            choices += [(prompt, c) for c in _choices(p)]
        ids = []
        try:
            for prompt, p in choices:
                ids.append(self.engine.add_request(prompt, p))
                self._boxes[ids[-1]] = []
        except Exception:
            self._drop(ids)
            raise
        last: dict[str, RequestOutput] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {rid: [] for rid in ids}
        left = set(ids)
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)
        try:
            while left:
                got = [rid for rid in self._drive() if rid in left]
                for rid in got:
                    box = self._boxes[rid]
                    for out in box:
                        logprobs[rid] += out.new_logprobs or ()
                        last[rid] = out
                        if out.finished:
                            left.discard(rid)
                            bar.update(1)
                    box.clear()
                if not got:  # (a step with nothing for this call: any of its requests gone?)
                    left = {rid for rid in left if rid in self.engine.requests}
        finally:
            bar.close()
            self._drop(ids)
        return [
            _completion(last.get(rid), logprobs[rid] if p.logprobs is not None else None, rid, q)
            for rid, (q, p) in zip(ids, choices)
        ]

    def _drive(self) -> list[str]:
        """One engine step; each output goes to the box of the call waiting for it (a
        stream's outputs are not lost to a generate call driving the engine, or to another
        stream), others (requests added on the engine directly) are dropped. Returns the
        ids of the requests that got one."""
        boxes, got = self._boxes, []
        for out in self.engine.step():
            box = boxes.get(out.request_id)
            if box is not None:
                box.append(out)
                got.append(out.request_id)
        return got

    def _drop(self, ids: list[str]) -> None:
        """The calls' requests are done with: aborted where still running, boxes gone."""
        for rid in ids:
            self._boxes.pop(rid, None)
            self.engine.abort_request(rid)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[CompletionOutput]:
        """Answer one conversation (a list of {"role", "content"} messages) or several (a
        list of them) through the model's chat template; one output per conversation and
        choice (params with n choices give n in a row, as `generate`). The same prompt
        tokens as the server's /v1/chat/completions, so the same greedy text. `tools` are
        refused where the template renders none (as the server refuses them).

            out = llm.chat([{"role": "user", "content": "Tell me a joke."}])[0]
            print(out.text)
        """
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("no conversation to answer", "messages")
        one = not isinstance(messages[0], (list, tuple))  # (a message: a dict, or as below)
        conversations = [messages] if one else list(messages)
        for c in conversations:
            if not isinstance(c, (list, tuple)):
                raise InvalidRequestError(
                    "messages must be a conversation (a list of {'role', 'content'} dicts) or "
                    f"a list of them; got {c!r:.80}",
                    "messages",
                )
        template = dict(
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        prompts = [self.apply_chat_template(list(c), **template) for c in conversations]
        return self.generate(prompts, params, use_tqdm)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one prompt as it is decoded (no chat template: pass
        `apply_chat_template(messages)` for a conversation).

            for delta in llm.stream("Once upon a time"):
                print(delta, end="", flush=True)
        """
        params = params or SamplingParams()
        if params.n != 1:
            raise InvalidRequestError("a stream is one choice: n must be 1", "n")
        if self.tokenizer is None:  # (it would yield nothing)
            raise InvalidRequestError(
                "streaming text needs the model's tokenizer and this engine has none: use "
                "generate, whose outputs carry token ids",
                "prompt",
            )
        rid = self.engine.add_request(_as_prompt(prompt), params)
        box = self._boxes[rid] = []
        try:
            while True:
                while box:
                    out = box.pop(0)
                    if out.delta_text:
                        yield out.delta_text
                    if out.finished:
                        return
                if rid not in self.engine.requests:
                    return  # aborted: it left without a last output
                self._drive()
        finally:
            self._drop([rid])


# apply_chat_template's own arguments, which LLM's set: not the template's variables
_TEMPLATE_ARGUMENTS = ("conversation", "add_generation_prompt", "tokenize", "tools")


def _template_kwargs(kwargs: dict | None) -> dict:
    """chat_template_kwargs as the template's variables, or InvalidRequestError."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidRequestError(
            f"chat_template_kwargs must map names to values; got {kwargs!r:.80}",
            "chat_template_kwargs",
        )
    taken = [k for k in _TEMPLATE_ARGUMENTS if k in kwargs]
    if taken:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(taken)}: pass it as the argument "
            "of chat or apply_chat_template",
            "chat_template_kwargs",
        )
    return kwargs


def _as_prompt(prompt):
    """An array of token ids (numpy's, torch's) as a list of Python values; anything else
    as it is."""
    if hasattr(prompt, "tolist") and hasattr(prompt, "ndim") and prompt.ndim > 0:
        return prompt.tolist()
    return prompt


def _message(message: Message, i: int) -> Message:
    """A message as templates read it: a dict with a role (a template failed on one
    without, deep in jinja) and text content, OpenAI-style parts as their texts joined (a
    template would render the list itself; other kinds of parts are refused), none as ""
    (as the server sends it). Messages as pydantic models or dataclasses (which transformers
    takes too) as their dicts."""
    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    elif dataclasses.is_dataclass(message) and not isinstance(message, type):
        message = dataclasses.asdict(message)
    if not isinstance(message, dict):
        raise InvalidRequestError(
            f"messages[{i}] must be a dict with a role and a content; got {message!r:.80}",
            "messages",
        )
    if not isinstance(message.get("role"), str):
        raise InvalidRequestError(f"messages[{i}] needs a role (a string)", "messages")
    content = message.get("content")
    if content is None:
        return {**message, "content": ""}
    if isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"messages[{i}]: content must be text or a list of text parts; got {content!r:.80}",
            "messages",
        )
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise InvalidRequestError(
                f"messages[{i}]: only text content parts are supported; got {part!r:.80}",
                "messages",
            )
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"messages[{i}]: a text part needs its text", "messages")
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}


def _choices(params: SamplingParams) -> list[SamplingParams]:
    """A prompt's n choices as one-choice params each, seeded ones by `choice_seed` of their
    index among the prompt's choices (never of the prompt's place in the batch), as the
    server's."""
    if params.n == 1:
        return [params]
    return [
        replace(params, n=1, seed=None if params.seed is None else choice_seed(params.seed, i))
        for i in range(params.n)
    ]


def _completion(
    out: RequestOutput | None,
    logprobs: list[TokenLogprobs] | None,
    request_id: str = "",
    prompt: Prompt = "",
) -> CompletionOutput:
    if out is None:  # aborted before its first token
        return CompletionOutput(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=[] if isinstance(prompt, str) else list(prompt),
            text="",
            token_ids=[],
            finish_reason="abort",
            logprobs=logprobs,
        )
    return CompletionOutput(
        request_id=out.request_id,
        prompt=out.prompt,
        prompt_token_ids=out.prompt_token_ids,
        text=out.text,
        token_ids=out.token_ids,
        finish_reason=out.finish_reason or "abort",
        spec_stats=out.spec_stats,
        logprobs=logprobs,
        prompt_logprobs=list(out.prompt_logprobs) if out.prompt_logprobs is not None else None,
    )
