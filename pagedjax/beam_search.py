"""Beam search as vLLM offers it: beams are requests that fork their parent's blocks
copy-on-write, so every prefix the beams agree on is stored once.

    outputs = LLM(...).beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=32))

Each beam runs greedy with its top-2k candidates as logprobs; after every token the search keeps
the k best continuations over all beams: the first continuation of a beam keeps its request
(the candidate replaces the greedy token, which is not computed yet), further ones fork it
(`Scheduler.fork_request`), and beams that lost are aborted, their unshared blocks freed.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedjax.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["BeamSearchParams", "BeamSearchOutput", "BeamSequence", "beam_search"]


@dataclass
class BeamSequence:
    tokens: list[int]          # prompt + generated
    cum_logprob: float
    text: str | None = None    # the whole sequence decoded, prompt included (as vLLM's beam search)
    finished: bool = False


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSequence]
    physical_blocks_peak: int = 0      # blocks the beams held at once (shared blocks counted once)
    cloned_blocks_peak: int = 0        # what cloning every beam's whole cache would have taken
    physical_block_steps: int = 0      # the same two summed over the search's tokens: their ratio
    cloned_block_steps: int = 0        # is the memory sharing saves on average


def beam_search(engine, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search for each prompt (a string, token ids or a dict) on an idle `engine`."""
    k = params.beam_width
    if 2 * k > engine.max_logprobs:
        raise ValueError(f"beam_width ({k}) needs 2 x beam_width <= max_logprobs ({engine.max_logprobs})")
    if k > engine.config.max_num_seqs:
        raise ValueError(f"beam_width ({k}) exceeds max_num_seqs ({engine.config.max_num_seqs})")
    with engine.synchronous():  # the search picks each token before the next step reads it
        return [_search(engine, p, params) for p in ([prompts] if isinstance(prompts, (str, dict)) else list(prompts))]


def _search(eng, prompt, params: BeamSearchParams) -> BeamSearchOutput:
    sched = eng.scheduler
    k = params.beam_width
    eos = None if params.ignore_eos else (min(eng.eos_token_ids) if eng.eos_token_ids else None)
    # beams run greedy with their top-2k candidates; the search, not the scheduler, decides
    # when a beam ends, so the scheduler's own limit is one token further out
    sp = SamplingParams(temperature=0, max_tokens=params.max_tokens + 1, ignore_eos=True, logprobs=2 * k)
    root = eng.add_request(None, prompt, sp)
    prompt_len = sched.requests[root].num_prompt_tokens
    beams: dict[str, float] = {root: 0.0}     # live request id -> cumulative logprob
    finished: list[BeamSequence] = []
    peak_phys = peak_clone = sum_phys = sum_clone = 0
    forks = 0
    try:
        for n in range(1, params.max_tokens + 1):
            # run until every live beam has sampled its n-th token (and its candidates)
            while any(sched.requests[rid].num_output_tokens < n for rid in beams):
                eng.step()
            live = {rid: sched.requests[rid] for rid in beams}
            cands = sorted(((beams[rid] + lp, rid, tok) for rid, req in live.items()
                            for tok, lp in zip(req.output_logprobs[-1][1], req.output_logprobs[-1][2])),
                           key=lambda c: -c[0])
            chosen = []
            for score, rid, tok in cands:
                if eos is not None and tok == eos:
                    if len(finished) < k:
                        finished.append(BeamSequence(live[rid].all_token_ids[:-1] + [tok], score, finished=True))
                    continue
                chosen.append((score, rid, tok))
                if len(chosen) == k:
                    break
            new_beams: dict[str, float] = {}
            for score, rid, tok in chosen:
                target = rid
                if rid in new_beams:  # the first continuation of a beam keeps its request
                    forks += 1
                    target = sched.fork_request(rid, f"{root}~{forks}").request_id
                # the n-th token is not computed yet: the chosen candidate replaces the greedy one
                sched.replace_last_token(target, tok)
                new_beams[target] = score
            for rid in live:
                if rid not in new_beams:
                    sched.abort_request(rid)
            phys = sched.kv.usage().used_blocks
            clone = sum(len(sched.kv.get_block_table(r)) for r in new_beams)
            peak_phys, peak_clone = max(peak_phys, phys), max(peak_clone, clone)
            sum_phys, sum_clone = sum_phys + phys, sum_clone + clone
            beams = new_beams
            if not beams:
                break
            if eos is not None and len(finished) >= k:
                best_live = max(beams.values()) / (n ** params.length_penalty)
                if min(_beam_score(f, prompt_len, params.length_penalty) for f in finished) >= best_live:
                    break  # no live beam can overtake the finished ones any more
        for rid, score in beams.items():
            finished.append(BeamSequence(list(sched.requests[rid].all_token_ids), score, finished=True))
    finally:
        for rid in list(beams):
            if rid in sched.requests:
                sched.abort_request(rid)
        eng.abort_request(root)  # the engine forgets the search's root request
    finished.sort(key=lambda b: -_beam_score(b, prompt_len, params.length_penalty))
    for b in finished:
        if eng.tokenizer is not None:  # a HF directory without tokenizer files: token ids only
            b.text = eng.tokenizer.decode(b.tokens)
    return BeamSearchOutput(finished[:k], peak_phys, peak_clone, sum_phys, sum_clone)


def _beam_score(b: BeamSequence, prompt_len: int, length_penalty: float) -> float:
    """Cumulative logprob / generated length ** length_penalty (HF's and vLLM's ranking)."""
    n = max(len(b.tokens) - prompt_len, 1)
    return b.cum_logprob / (n ** length_penalty)
