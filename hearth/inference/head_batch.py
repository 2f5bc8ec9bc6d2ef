"""Batched head steps: the next token of several sessions from their last hidden states, with one final norm +
lm_head product for all of them and each session's own sampling (its parameters, its generator).

Parity with a session's solo step (Head.logits + Head.sample), row by row:
- greedy rows take the argmax of their batched logits when it leads the runner-up by more than twice the row's
  rounding bound (Head.batch_logits): both products then have the same argmax. A row whose best two are closer (a
  near tie, where the batched kernel's rounding could flip the token) is recomputed alone, so it picks exactly the
  token it picks alone;
- rows sampled with a seed are computed alone too: their tokens then depend on the seed only, never on which other
  sessions shared the batch (a rounding difference of 1e-6 could move a draw across a bucket edge);
- rows sampled without a seed promise no reproducibility and use their batched logits;
- rows with a logit bias, a penalty or log-probabilities asked for (``shaping``) are computed alone too: their
  reported log-probabilities are then exactly their solo ones, and their tokens those of the same shaped logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .head import Head
from .logit_shaping import LogitShaping
from .sampling import SamplingParams


@dataclass(frozen=True)
class HeadRow:
    """One session's head step: the hidden states ``[1, T, hidden]`` that left its last layer, and how it samples
    (``shaping``: the session's bias, penalties and log-probabilities; None when its parameters ask for none)."""

    hidden_states: torch.Tensor
    params: SamplingParams
    generator: torch.Generator | None = None
    shaping: LogitShaping | None = None


def solo_next_token(head: Head, row: HeadRow) -> int:
    """The row's next token computed alone (the reference the batched path matches)."""
    logits = head.logits(row.hidden_states)
    if row.shaping is None:
        return head.sample(logits, row.params, row.generator)
    return row.shaping.next_token(logits, row.generator)


def batched_next_tokens(head: Head, rows: Sequence[HeadRow]) -> list[int | Exception]:
    """Each row's next token (or the error of its own malformed input); the product is shared by the sound rows."""
    outcomes: list[int | Exception | None] = [None] * len(rows)
    batched: list[int] = []
    for index, row in enumerate(rows):
        if row.shaping is None and (row.params.greedy or row.params.seed is None):
            batched.append(index)
        else:
            outcomes[index] = _alone(head, row)
    sound = [index for index in batched if _well_shaped(head, rows[index].hidden_states)]
    for index in set(batched) - set(sound):
        outcomes[index] = _alone(head, rows[index])  # raises its own shape error
    if len(sound) == 1:
        outcomes[sound[0]] = _alone(head, rows[sound[0]])
    elif sound:
        logits, bounds = head.batch_logits([rows[index].hidden_states for index in sound])
        for position, index in enumerate(sound):
            outcomes[index] = _pick(head, rows[index], logits[position], float(bounds[position]))
    return outcomes


def _pick(head: Head, row: HeadRow, logits: torch.Tensor, bound: float) -> int:
    if not row.params.greedy:
        return head.sample(logits, row.params, row.generator)
    best, runner_up = torch.topk(logits, 2).values.tolist()
    if best - runner_up > 2 * bound:
        return int(torch.argmax(logits))
    return solo_next_token(head, row)


def _alone(head: Head, row: HeadRow) -> int | Exception:
    try:
        return solo_next_token(head, row)
    except ValueError as error:
        return error


def _well_shaped(head: Head, hidden_states: torch.Tensor) -> bool:
    return hidden_states.dim() == 3 and hidden_states.shape[0] == 1 and hidden_states.shape[2] == head.info.hidden_size
