"""The native engine's optional per-request outputs, computed only for the requests that ask:
prompt logprobs, the stream events of a step, and a completion's MoE routing. Pure functions over
the running batch and its groups (the engine calls them from its step).

Legend: P prompt tokens, V vocabulary, B live rows, C completion tokens, L MoE layers, k experts
per token.
"""

from __future__ import annotations

import torch

from slipstream.engine.base import StreamEvent
from slipstream.engine.batch import Group, RunningBatch


def set_prompt_logprobs(g: Group, logits_PV: torch.Tensor) -> None:
    """g.prompt_logprobs[j] = log p(prompt[j] | prompt[:j]) for j >= 1 under the model's own
    distribution (no temperature or filters: nothing was sampled there), None for j = 0; plus
    g.prompt_top (top-n alternatives per position) when the params ask for n > 0.
    `logits_PV`: the admission forward's logits at prompt positions 0..P-2."""
    lp_PV = torch.log_softmax(logits_PV.float(), dim=-1)
    targets = torch.tensor(g.prompt_ids[1:], device=lp_PV.device)
    own = lp_PV.gather(1, targets[:, None])[:, 0].tolist()
    g.prompt_logprobs = [None, *own]
    n = g.params.prompt_logprobs or 0
    if n:
        values, ids = lp_PV.topk(n, dim=-1)
        pairs = [
            list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
        ]
        g.prompt_top = [None, *pairs]


def stream_events(
    batch: RunningBatch, tokens: list[int], logprobs: list[float], version: int
) -> list[tuple[Group, StreamEvent]]:
    """The StreamEvent of each streaming row for the token it just sampled (after `record`),
    from the step's host copy of every row's token and logprob; a sample's first event carries
    its prompt logprobs."""
    rows = batch.stream_rows
    toks, lps = [tokens[i] for i in rows], [logprobs[i] for i in rows]
    out = []
    for i, tok, lp in zip(rows, toks, lps, strict=True):
        row = batch.rows[i]
        g, top = row.group, None
        row.streamed += 1
        gen = row.streamed  # = gen_N[i], without reading it from the device
        if g.params.top_logprobs:
            top = batch.top_of(i, gen - 1, gen)[0]
        first = gen == 1 and g.prompt_logprobs is not None
        event = StreamEvent(
            row.index, tok, lp, version, top,
            prompt_logprobs=g.prompt_logprobs if first else None,
            prompt_top_logprobs=g.prompt_top if first else None,
        )  # fmt: skip
        out.append((g, event))
    return out


def completion_routing(
    g: Group, decode_CLk: torch.Tensor | None, num_tokens: int
) -> torch.Tensor | None:
    """The completion's (P + C - 1, L, k) routing as a normal CPU tensor (the caller may write
    into it), or None when the request did not record: the group's prefill rows, then the rows
    of the fed-back tokens 0..C-2 (`RowOutput.decode_routing_CLk`)."""
    if g.prompt_routing_PLk is None:
        return None
    parts = [g.prompt_routing_PLk] if decode_CLk is None else [g.prompt_routing_PLk, decode_CLk]
    with torch.inference_mode(False):
        return torch.cat(parts)[: len(g.prompt_ids) + num_tokens - 1].cpu().clone()
