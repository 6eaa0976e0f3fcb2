"""Prompt logprobs: how the model scores each prompt token, computed in the prefill pass.

Lifecycle: a request whose params ask for `prompt_logprobs` (k) starts with an empty score list
on its Sequence (`prompt_scores`). Each step that computes a chunk of its prompt, the runner
also asks the model for the logits of the chunk's rows that predict a prompt token not yet
scored (`score_positions`: row p predicts token p + 1), and `score` turns them into one
`PromptScore` per row, which the engine appends. When its first output token is appended, the
engine hands the whole list out (StepOutput.prompt_logprobs: the prefill worker's hand-off
carries it on) and the sequence scores no more, so a recompute after preemption does not score
twice. A scoring sequence skips the prefix cache (a cached block's rows are never computed) and
computes at most SCORE_CHUNK prompt tokens a step, so one step's scored logits stay bounded
(SCORE_CHUNK x vocab floats). `score_reference` is the slow one-row-at-a-time twin of `score`.
"""
from __future__ import annotations

import torch

# (the prompt token's logprob, its rank: 1 = the most likely, the top-k [(token id, logprob)] descending)
PromptScore = tuple[float, int, list[tuple[int, float]]]

SCORE_CHUNK = 256  # prompt tokens a scoring sequence computes per step (each needs a row of vocab logits)


def score_positions(seq, start: int, end: int) -> range:
    """Positions of [start, end) (a step's chunk of seq) whose rows score a prompt token not yet scored."""
    return range(max(start, len(seq.prompt_scores)), min(end, len(seq.prompt_token_ids) - 1))


def score(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[PromptScore]:
    """logits (N, V): row i predicts targets[i]; each row's score with its top-ks[i] alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(targets, dtype=torch.int64, device=lp.device).unsqueeze(1))  # (N, 1)
    ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
    k_max = min(max(ks), lp.shape[1])
    top_ids, top_values = ([[] for _ in targets],) * 2
    if k_max > 0:
        top = lp.topk(k_max, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return [(c, r, list(zip(i[:k], v[:k]))) for c, r, i, v, k in zip(chosen.squeeze(1).tolist(), ranks, top_ids, top_values, ks)]


def score_reference(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[PromptScore]:
    """Slow twin of `score`: one row at a time."""
    out = []
    for row, t, k in zip(logits, targets, ks):
        lp = torch.log_softmax(row.float(), dim=0)
        rank = 1 + sum(1 for x in lp.tolist() if x > float(lp[t]))
        top = lp.topk(min(k, lp.shape[0]))
        out.append((float(lp[t]), rank, list(zip(top.indices.tolist(), top.values.tolist()))))
    return out
