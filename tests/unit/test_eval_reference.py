"""`hearth eval --reference`: the schemes measured against another full-precision checkpoint of the same model (the
one a GGUF was made from), so what the file's own quantization loses counts too; a checkpoint of another model is
refused in one line."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType

from hearth.services.devtools.bench.eval_options import EvalOptions
from hearth.services.devtools.bench.quality import EvalInputError, evaluate, format_eval_report

from .gguf_files import own_cache, tiny_gguf  # noqa: F401  (fixtures)
from .inference_tiny_models import one_torch_thread  # noqa: F401  (fixture)
from .test_held_forms import mix_and_source  # noqa: F401  (a fixture)

WINDOWS = dict(context_tokens=16, max_tokens=32)


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("the quick brown fox jumps over the lazy dog " * 8)
    return path


def test_a_gguf_against_a_checkpoint_of_its_very_values_loses_nothing(tiny_gguf, text):
    path, reference = tiny_gguf("llama", GGMLQuantizationType.Q4_1)  # reference: the values the GGUF's reader gives
    report = evaluate(EvalOptions(text=text, model=str(path), reference=str(reference), schemes=("none",), **WINDOWS))
    (none,) = report.schemes
    assert (none.mean_kl_nats, none.top1_agreement) == (0.0, 1.0)
    assert report.reference == str(reference)


def test_against_the_floats_a_mix_was_made_from_the_files_own_rounding_counts(mix_and_source, text):
    mix, source = mix_and_source
    report = evaluate(EvalOptions(text=text, model=str(mix), reference=str(source),
                                  schemes=("none", "int8", "int4/g32"), **WINDOWS))
    none, int8, int4 = report.schemes
    assert none.mean_kl_nats > 0  # the file's 4- and 6-bit rounding, which its own float32 copy hides
    assert (int4.mean_kl_nats, int4.top1_agreement) == (int8.mean_kl_nats, int8.top1_agreement)
    # What each costs a host: float32; the same int4 and int6-as-int8 mix under both schemes.
    assert none.bits_per_weight == 32.0 and 5 < int4.bits_per_weight == int8.bits_per_weight < 8
    assert format_eval_report(report).splitlines()[0].endswith(f", against {source}")
    alone = evaluate(EvalOptions(text=text, model=str(mix), schemes=("int4/g32",), **WINDOWS))
    assert alone.reference is None and int4.mean_kl_nats > alone.schemes[0].mean_kl_nats


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tiny_gguf, text):
    path, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    other, _ = tiny_gguf("llama", GGMLQuantizationType.Q8_0, vocab_size=384)
    with pytest.raises(EvalInputError, match=r"^--reference: a vocabulary of 384 tokens, the model's 320: not a "):
        evaluate(EvalOptions(text=text, model=str(path), reference=str(other), schemes=("int8",), **WINDOWS))
    with pytest.raises(EvalInputError, match=r"^--reference: "):
        evaluate(EvalOptions(text=text, model=str(path), reference=str(text.parent / "absent"), schemes=("int8",),
                             **WINDOWS))
