"""`hearth eval`'s measures on hand-made logits (KL, top-1 agreement, perplexity), its windows and its text checks."""

from __future__ import annotations

import math

import pytest
import torch

from hearth.services.devtools.bench.quality import EvalInputError, read_eval_text, token_windows
from hearth.services.devtools.bench.quality_metrics import QualityTotals, compare_logits


def test_equal_logits_give_zero_kl_full_agreement_and_equal_perplexities():
    torch.manual_seed(0)
    logits = torch.randn(7, 50) * 4
    targets = torch.randint(0, 50, (7,))
    totals = compare_logits(logits, logits.clone(), targets)
    assert totals.positions == 7
    assert totals.mean_kl_nats == 0.0 and totals.max_kl_nats == 0.0
    assert totals.top1_agreement == 1.0
    assert totals.reference_perplexity == totals.quantized_perplexity


def test_a_known_case():
    # Position 0: both (3/4, 1/4). Position 1: reference (3/4, 1/4), quantized (1/4, 3/4): KL = ln 3 / 2.
    reference = torch.log(torch.tensor([[3.0, 1.0], [3.0, 1.0]]))
    quantized = torch.log(torch.tensor([[3.0, 1.0], [1.0, 3.0]]))
    totals = compare_logits(reference, quantized, torch.tensor([0, 0]))
    assert totals.mean_kl_nats == pytest.approx(math.log(3) / 4)
    assert totals.max_kl_nats == pytest.approx(math.log(3) / 2)
    assert totals.top1_agreement == 0.5
    assert totals.reference_perplexity == pytest.approx(4 / 3)
    assert totals.quantized_perplexity == pytest.approx(math.exp(-(math.log(0.75) + math.log(0.25)) / 2))


def test_kl_is_never_negative_and_grows_with_the_distance():
    torch.manual_seed(1)
    reference = torch.randn(16, 100)
    noise = torch.randn(16, 100)
    near = compare_logits(reference, reference + 0.01 * noise, torch.zeros(16, dtype=torch.long))
    far = compare_logits(reference, reference + 1.0 * noise, torch.zeros(16, dtype=torch.long))
    assert 0.0 <= near.mean_kl_nats < far.mean_kl_nats
    assert near.top1_agreement >= far.top1_agreement


def test_totals_of_windows_add_up():
    first = QualityTotals(positions=2, kl_sum_nats=0.2, max_kl_nats=0.15, agreements=2,
                          reference_nll_sum_nats=2.0, quantized_nll_sum_nats=2.2)
    second = QualityTotals(positions=3, kl_sum_nats=0.3, max_kl_nats=0.1, agreements=1,
                           reference_nll_sum_nats=3.0, quantized_nll_sum_nats=3.3)
    total = QualityTotals() + first + second
    assert total.positions == 5 and total.agreements == 3 and total.max_kl_nats == 0.15
    assert total.mean_kl_nats == pytest.approx(0.1) and total.top1_agreement == pytest.approx(0.6)
    assert total.reference_perplexity == pytest.approx(math.e)
    assert math.isnan(QualityTotals().mean_kl_nats)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="logits"):
        compare_logits(torch.zeros(3, 5), torch.zeros(3, 6), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        compare_logits(torch.zeros(3, 5), torch.zeros(3, 5), torch.zeros(2, dtype=torch.long))


def test_windows_split_the_tokens_and_drop_a_last_one_that_predicts_nothing():
    assert token_windows(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]
    assert token_windows(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert token_windows([5], 3) == []


@pytest.mark.parametrize(("content", "named"), [
    (None, "no such file"), (b"", "empty"), (b" \n\t", "empty"), (b"caf\xe9 au lait", "not UTF-8")])
def test_unreadable_texts_are_refused_in_one_line(tmp_path, content, named):
    path = tmp_path / "text.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(EvalInputError, match=named) as refused:
        read_eval_text(path)
    assert "\n" not in str(refused.value) and str(path) in str(refused.value)
