"""SchedulerOutput: everything the runner must do in one step, decided by the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedjax.scheduler.sequence import Request


@dataclass
class SchedulerOutput:
    """Everything the runner must do in one step. Row i of the batch is `scheduled[i]`."""

    step: int
    scheduled: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)   # tokens computed for each row this step
    sample_from: list[int] = field(default_factory=list)      # the row whose last token's logits it samples
    needs_sample: list[bool] = field(default_factory=list)    # False for a prefill chunk before the prompt's end
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks, before the forward
    # (src, dst) device blocks copied *after* the forward pass: a contiguous fork copies the
    # prompt the parent's last chunk writes in this very step
    block_copies_after: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)      # (device, host) blocks
    swap_in: list[tuple[int, int]] = field(default_factory=list)       # (host, device) blocks
    preempted: list[str] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_rows(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing for the device: no row and no block to move (a swap-in whose request gets no
        row this step, its next block not free yet, must still be copied back)."""
        return not (self.scheduled or self.swap_out or self.swap_in or self.block_copies or self.block_copies_after)

    def add_row(self, req: Request, num_new: int, sample_from: int | None = None) -> None:
        """Row i of the step: `req` computes `num_new` tokens and samples from row `sample_from`
        (its own by default; a forked sample reads its parent's)."""
        row = len(self.scheduled)
        self.scheduled.append(req)
        self.num_new_tokens.append(num_new)
        self.sample_from.append(row if sample_from is None else sample_from)
        num_computed = req.num_computed_tokens
        self.needs_sample.append(num_computed + num_new >= len(req.all_token_ids))
        if num_new == 1 and num_computed >= len(req.prompt_token_ids):
            self.num_decode_tokens += 1
        else:
            self.num_prefill_tokens += num_new
