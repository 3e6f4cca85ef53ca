"""Multi-turn conversations for the load generator: the workload whose prompts grow by one
question and one answer a turn, each turn resending the conversation so far (what a prefix
cache is for).

A conversation is one simulated user: its turns go one after another, turn t carrying the
earlier questions and the server's actual answers to them (the load generator fills those in
as they arrive) plus a new question. Under chat the history is user and assistant messages;
under completions it is text: the previous prompt, its answer and the new question, so each
turn's prompt starts with the previous turn's prompt and answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.bench.datasets import MULTI_TURN, BenchPrompt, Dataset, DatasetError, random_dataset

DEFAULT_TURNS = 4
TURN_SEPARATOR = "\n\n"  # completions: between an answer and the next question


@dataclass
class Conversation:
    """One user's conversation: `questions[t]` is the new user text of turn t and
    `max_tokens[t]` the tokens it asks for; `prefix` is the workload's shared prefix (the
    system message under chat, "" for none)."""

    questions: list[str]
    max_tokens: list[int]
    prefix: str = ""

    def __post_init__(self) -> None:
        if not self.questions or len(self.questions) != len(self.max_tokens):
            raise ValueError(
                f"a conversation needs one max_tokens per question; got {len(self.questions)} "
                f"questions and {len(self.max_tokens)} max_tokens"
            )

    @property
    def turns(self) -> int:
        return len(self.questions)

    def turn_prompt(self, turn: int, answers: list[str], chat: bool) -> BenchPrompt:
        """The request of `turn`, given the server's answers to the turns before it."""
        if len(answers) != turn:
            raise ValueError(f"turn {turn} needs the {turn} answers before it; got {len(answers)}")
        earlier = zip(self.questions, answers)
        if chat:
            prompt: str | list[dict] = [
                message
                for question, answer in earlier
                for message in (
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                )
            ]
            prompt.append({"role": "user", "content": self.questions[turn]})
        else:
            history = "".join(q + a + TURN_SEPARATOR for q, a in earlier)
            prompt = history + self.questions[turn]
        return BenchPrompt(prompt, self.max_tokens[turn], prefix=self.prefix)


def multi_turn_dataset(
    n: int,
    turns: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    tokenizer=None,
    seed: int | str = 0,
) -> Dataset:
    """n conversations of `turns` turns; every question is a random prompt of about
    input_len tokens (exact with a tokenizer, as `random_dataset`) asking for about
    output_len tokens."""
    if turns < 1:
        raise DatasetError(f"--turns must be >= 1; got {turns}")
    questions = random_dataset(n * turns, input_len, output_len, range_ratio, tokenizer, seed)
    conversations = []
    for i in range(n):
        mine = questions.prompts[i * turns : (i + 1) * turns]
        conversations.append(Conversation([q.prompt for q in mine], [q.max_tokens for q in mine]))
    notes = [
        *questions.notes,
        f"{n} conversations of {turns} turns: each turn sends the earlier questions and the "
        "server's answers, then a new question",
    ]
    return Dataset(MULTI_TURN, conversations, notes)
