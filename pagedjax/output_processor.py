"""From the scheduler's requests to vLLM's RequestOutputs: text as the tokens arrive, stop strings,
logprob objects, and what each output carries (RequestOutputKind).

One `_Group` per request the caller added (its n samples are the scheduler's requests "id",
"id#1", ...). After every step the engine hands over the requests that got a token or finished;
each sample's new tokens go through its IncrementalDetokenizer, its text is searched for stop
strings (a match ends the sample: the engine finishes it in the scheduler), and the group's
RequestOutput is built:
  CUMULATIVE  everything so far, every step (text held back by up to the longest stop string
              less one character while the sample runs, so a stop string is never shown)
  DELTA       only what is new since the group's previous output
  FINAL_ONLY  one output, when every sample has finished
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedjax.detokenizer import IncrementalDetokenizer, find_stop
from pagedjax.outputs import CompletionOutput, Logprob, RequestOutput, RequestStateStats
from pagedjax.sampling_params import RequestOutputKind, SamplingParams
from pagedjax.scheduler.sequence import Request, RequestStatus


@dataclass
class _Sample:
    detok: IncrementalDetokenizer | None
    seen: int = 0                 # generated tokens taken in so far
    text: str = ""                # the text so far (cut at a stop string)
    stop_reason: Any = None
    stopped: bool = False         # a stop string ended it
    sent_tokens: int = 0          # what DELTA outputs have handed out
    sent_text: int = 0
    sent_logprobs: int = 0


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_logprobs: list | None = None
    members: dict[int, Request] = field(default_factory=dict)
    samples: dict[int, _Sample] = field(default_factory=dict)


class OutputProcessor:
    """Turns the scheduler's requests into RequestOutputs (see the module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            first: Request) -> None:
        self.groups[request_id] = _Group(request_id, prompt, prompt_token_ids, params, members={0: first})

    def pop(self, request_id: str) -> _Group | None:
        return self.groups.pop(request_id, None)

    def process(self, changed: list[Request], finish: Callable[[str], None]) -> list[RequestOutput]:
        """Outputs of the groups whose samples changed; `finish(request_id)` ends a sample a stop
        string ended."""
        touched: dict[str, _Group] = {}
        for req in changed:
            group = self.groups.get(req.group_id)
            if group is None:
                continue
            group.members.setdefault(req.sample_index, req)
            self._take_tokens(group, req, finish)
            touched[group.request_id] = group
        outs = []
        for gid, group in touched.items():
            finished = self._finished(group)
            if not finished and group.params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue   # nothing to build until the end (building it every step costs O(tokens))
            outs.append(self._output(group, finished))
            if finished:
                del self.groups[gid]
        return outs

    def _take_tokens(self, group: _Group, req: Request, finish) -> None:
        sp = group.params
        s = group.samples.get(req.sample_index)
        if s is None:
            detok = None
            if sp.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                               skip_special_tokens=sp.skip_special_tokens)
            s = group.samples[req.sample_index] = _Sample(detok)
        new = req.output_token_ids[s.seen:]
        s.seen = len(req.output_token_ids)
        if s.detok is None or s.stopped or not new:
            return
        delta = s.detok.add(new)
        s.text += delta
        hit = find_stop(s.text, sp.stop_strings, len(delta), sp.include_stop_str_in_output)
        if hit is not None:
            s.stop_reason, end = hit
            s.text = s.text[:end]
            s.stopped = True
            if not req.is_finished:
                finish(req.request_id)

    @staticmethod
    def _finished(group: _Group) -> bool:
        members = [group.members.get(i) for i in range(group.params.n)]
        if all(m is not None and m.is_finished for m in members):
            return True
        parent = members[0]
        # an n > 1 parent that ended before its prompt completed (abort, error) forked no samples
        return parent.is_finished and parent.children == [] and group.params.n > 1 and not parent.forked

    def _output(self, group: _Group, finished: bool) -> RequestOutput:
        sp = group.params
        members = [group.members.get(i) for i in range(sp.n)]
        parent = members[0]
        delta = sp.output_kind == RequestOutputKind.DELTA
        outputs = []
        for i, m in enumerate(members):
            if m is None:
                continue
            s = group.samples.get(i) or _Sample(None)
            text = s.text
            if not m.is_finished and not s.stopped and sp.output_text_buffer_length:
                text = text[:max(0, len(text) - sp.output_text_buffer_length)]
            # DELTA: only what is new since the last output is copied and turned into Logprobs
            ids = m.output_token_ids[s.sent_tokens:] if delta else list(m.output_token_ids)
            lps = self._logprobs(m, sp, s.sent_logprobs if delta else 0)
            cum = float(sum(x[0] for x in m.output_logprobs)) if sp.logprobs is not None and m.output_logprobs else None
            if delta:
                text = text[s.sent_text:]
                s.sent_tokens += len(ids)
                s.sent_text += len(text)
                s.sent_logprobs += len(lps or ())
            reason = "stop" if s.stopped else m.finish_reason
            stop_reason = s.stop_reason
            if stop_reason is None and m.status == RequestStatus.FINISHED_STOPPED and m.output_token_ids:
                last = m.output_token_ids[-1]
                stop_reason = last if last != m.eos_token_id else None
            outputs.append(CompletionOutput(i, text, ids, cum, lps, reason if m.is_finished or s.stopped else None,
                                            stop_reason))
        prompt_logprobs = self._prompt_logprobs(group, parent)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, prompt_logprobs, outputs,
                             finished, _stats(parent, members), max(parent.num_cached_tokens, 0),
                             [m.record for m in members if m is not None and m.record is not None] if finished else [])

    def _logprobs(self, m: Request, sp: SamplingParams, start: int = 0):
        """Per generated token from `start` on, {token id: Logprob}: the top `logprobs` (ranks
        1..k) and the sampled token with its own rank."""
        if sp.logprobs is None:
            return None
        decode = self._decode if sp.detokenize else (lambda t: None)
        return [self._logprob_dict(tok, entry, sp.logprobs, decode)
                for tok, entry in zip(m.output_token_ids[start:], m.output_logprobs[start:])]

    def _prompt_logprobs(self, group: _Group, parent: Request):
        """vLLM's prompt_logprobs once the prompt's are all recorded: None for the first prompt
        token (nothing predicts it), then {token id: Logprob} per token as for generated ones. A
        DELTA request gets them once, in its first output after they are complete."""
        sp = group.params
        if sp.prompt_logprobs is None or parent.skip_prefix_cache:
            return None
        if group.prompt_logprobs is None:
            decode = self._decode if sp.detokenize else (lambda t: None)
            group.prompt_logprobs = [None] + [
                self._logprob_dict(tok, entry, sp.prompt_logprobs, decode)
                for tok, entry in zip(parent.prompt_token_ids[1:], parent.prompt_logprobs)]
        elif sp.output_kind == RequestOutputKind.DELTA:
            return None
        return group.prompt_logprobs

    @staticmethod
    def _logprob_dict(tok: int, entry, k: int, decode) -> dict[int, Logprob]:
        """The top k of `entry` = (token's logprob, top ids, top logprobs[, token's rank]) with
        ranks 1..k, and `tok` with its own rank if it is not among them."""
        lp, ids, vals = entry[:3]
        d = {int(t): Logprob(float(v), r + 1, decode(t)) for r, (t, v) in enumerate(zip(ids[:k], vals[:k]))}
        if tok not in d:
            d[tok] = Logprob(float(lp), entry[3] if len(entry) > 3 else None, decode(tok))
        return d

    def _decode(self, token_id) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)


def _stats(parent: Request, members) -> RequestStateStats:
    t = parent.times
    last = max((m.times.token_times[-1] for m in members if m is not None and m.times.token_times), default=0.0)
    return RequestStateStats(
        num_generation_tokens=sum(m.num_output_tokens for m in members if m is not None),
        arrival_time=t.arrival, queued_ts=t.arrival, scheduled_ts=t.first_scheduled or 0.0,
        first_token_ts=t.first_token or 0.0, last_token_ts=last, finished_ts=t.finished or 0.0,
        num_preemptions=sum(m.num_preemptions for m in members if m is not None))
