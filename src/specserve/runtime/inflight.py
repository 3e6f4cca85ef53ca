"""What the step in flight leaves on the device for the next step (overlap scheduling), and
how the next step's input ids are taken from it there (`place_device_tokens`).

Under overlap scheduling step N+1 is built before step N's tokens reach the host. The host
counts N as one token per sampled request (`Request.num_inflight`) and packs N+1 as if N
accepted no draft; what N really committed is read on the device: N+1's input token is
N's last drawn token, its positions, KV slots and seq_lens move right by N's accept length,
and the EAGLE-3 drafter's catch-up takes N's tokens from here (N's features are in the
feature store by then: the device runs N's forward first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.runtime.packing import to_device, upload


@dataclass
class CatchUpTail:
    """Catch-up tokens still on the device: the last lens[b] token ids of segment b (0: none)
    are tokens[rows[b], :lens[b]], the step in flight's accepted drafts and bonus, padded to
    its draft count; only the first accepted[b] + 1 of them are committed, so segment b
    drafts from its row len(b) - lens[b] + accepted[b]. Its other rows write K/V past the
    committed length, overwritten before anything reads them (as rejected drafts are)."""

    tokens: torch.Tensor  # [R, W]
    rows: list[int]
    lens: list[int]
    accepted: torch.Tensor  # [B]

    def index(self, row_starts: list[int], seg_lens: list[int]) -> tuple[list, list, list]:
        """(dest, src, last): packed rows of the tail tokens, their flat index in `tokens`,
        and each segment's last committed row if nothing was accepted (add `accepted`)."""
        dest, src, last, max_q_len = [], [], [], self.tokens.shape[1]
        for start, n, row, k in zip(row_starts, seg_lens, self.rows, self.lens):
            dest += range(start + n - k, start + n)
            src += range(row * max_q_len, row * max_q_len + k)
            last.append(start + n - max(k, 1))
        return dest, src, last


@dataclass
class InflightStep:
    """Step N's results on the device, by row: its sampled requests in order.

    Row r drew tokens[r, :accept_len[r] + 1] after drafted[r] drafts (`accept_len` None:
    a plain step, one token per row). `scheduled` are N's scheduled requests (sampled or
    not: a prefill chunk that drew no token fed the target too). `consumed` collects the
    requests whose drafter the next step caught up on N's rows (so N's resolve adds their
    accept lengths to the drafter's cached length).
    """

    tokens: torch.Tensor  # [R, W]
    accept_len: torch.Tensor | None  # [R]
    rows: dict[int, int]  # id(request) -> row
    drafted: list[int]  # ScheduledRequest.drafted of each row
    scheduled: list = field(default_factory=list)  # ScheduledRequest of step N
    consumed: set[int] = field(default_factory=set)
    _padded: torch.Tensor | None = field(default=None, repr=False)  # accept_len, then a 0

    @property
    def speculative(self) -> bool:
        return self.accept_len is not None

    @property
    def last_tokens(self) -> torch.Tensor:
        """[R]: each row's last drawn token (the next step's input)."""
        if self.accept_len is None:
            return self.tokens[:, 0]
        return self.tokens.gather(1, self.accept_len[:, None])[:, 0]

    def accepted(self, rows: list[int]) -> torch.Tensor:
        """[len(rows)] on the device: the accept length of each row (0 for -1: a request
        that was not in step N, and for every row of a plain step)."""
        device = self.tokens.device
        if self.accept_len is None:
            return torch.zeros(len(rows), dtype=torch.int64, device=device)
        last = len(self.drafted)
        if len(rows) == last and rows == list(range(last)):  # the same requests in order
            return self.accept_len
        if self._padded is None:
            self._padded = torch.cat([self.accept_len, self.accept_len.new_zeros(1)])
        return self._padded[to_device([r if r >= 0 else last for r in rows], device)]

    def catch_up_tail(self, rows: list[int]) -> CatchUpTail:
        """The drafter's catch-up inputs from this step for requests at `rows` (-1: not in
        this step): each one's drawn tokens, as many as it may have committed."""
        lens = [self.drafted[r] + 1 if r >= 0 else 0 for r in rows]
        return CatchUpTail(self.tokens, rows, lens, self.accepted(rows))


def place_device_tokens(batch, input_ids, last_rows, missing, prev_rows, prev, device) -> None:
    """Input ids that are still on the device, copied there (queued behind the step in
    flight): each missing last committed token from prev's drawn tokens, drafts from
    the proposer's tensor. The row indices go up in one copy."""
    if _place_dense(batch, input_ids, missing, prev_rows, prev):
        return
    lists, sources = [], []
    if missing:
        lists += [
            [last_rows[i] - batch[i].drafted for i in missing],
            [prev_rows[i] for i in missing],
        ]
        sources.append(prev.last_tokens)
    by_tensor: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for i, s in enumerate(batch):
        if s.device_drafts is None:
            continue
        tokens, row = s.device_drafts
        _, dest, src = by_tensor.setdefault(id(tokens), (tokens, [], []))
        draft_len = s.draft_len
        dest += range(last_rows[i] - draft_len + 1, last_rows[i] + 1)
        src += range(row * tokens.shape[1], row * tokens.shape[1] + draft_len)
    for tokens, dest, src in by_tensor.values():
        lists += [dest, src]
        sources.append(tokens.reshape(-1))
    if not lists:
        return
    index = upload(lists, device)
    for source, dest, src in zip(sources, index[0::2], index[1::2]):
        input_ids[dest] = source[src]


def _place_dense(batch, input_ids, missing, prev_rows, prev) -> bool:
    """The common speculative step under overlap: every request was row b of the step
    in flight and drafts draft_len tokens into row b of one device tensor, so its q_len inputs
    are that step's last drawn token and its drafts: two copies, nothing uploaded."""
    n = len(batch)
    first = batch[0].device_drafts
    if first is None or len(missing) != n or len(prev.drafted) != n or prev_rows[-1] != n - 1:
        return False
    drafts = first[0]
    draft_len = drafts.shape[1]
    q_len = draft_len + 1
    if input_ids.shape[0] != n * q_len or drafts.shape[0] != n or prev_rows != list(range(n)):
        return False
    for b, s in enumerate(batch):
        dev = s.device_drafts
        if dev is None or dev[0] is not drafts or dev[1] != b or s.draft_len != draft_len:
            return False
    rows = input_ids.view(n, q_len)
    rows[:, 0] = prev.last_tokens
    rows[:, 1:] = drafts
    return True
