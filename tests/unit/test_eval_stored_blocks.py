"""`hearth eval` of a GGUF whose layers are stored in 4-bit blocks of 32 (Q4_1 here) says that int8 and int4/g32
serve those blocks as they are stored (hearth/inference/held_forms.py held_as_stored), in its table and its JSON:
before, the two schemes' identical figures on such a file read like a bug."""

from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType

from hearth.inference.gguf_checkpoint import gguf_config
from hearth.inference.memory import weights_held_as_stored
from hearth.services.devtools.bench.eval_options import EvalOptions
from hearth.services.devtools.bench.quality import evaluate, format_eval_report

from .gguf_files import own_cache, tiny_gguf  # noqa: F401  (fixtures)
from .inference_tiny_models import one_torch_thread  # noqa: F401  (fixture)

LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


def test_eval_says_which_schemes_serve_a_ggufs_stored_4_bit_blocks_as_they_are(tiny_gguf, tmp_path):
    path, _ = tiny_gguf("llama", GGMLQuantizationType.Q4_1)
    layer_weights = LINEARS_PER_LAYER * gguf_config(path).num_hidden_layers
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 8)
    report = evaluate(EvalOptions(text=text, model=str(path), schemes=("int8", "int4/g32", "int4/g64"),
                                  context_tokens=16, max_tokens=32))

    int8, int4_g32, int4_g64 = report.schemes
    for row in (int8, int4_g32):
        assert row.held_as_stored is not None
        assert (row.held_as_stored.weights, row.held_as_stored.held_in) == ({"Q4_1": layer_weights}, "int4/g32")
    assert int4_g64.held_as_stored is None  # another group: it rounds the weights itself
    assert int8.bits_per_weight == int4_g32.bits_per_weight > int4_g64.bits_per_weight  # g64: fewer scales
    carried = json.loads(report.model_dump_json())["schemes"]
    assert [row["held_as_stored"] for row in carried] == [
        {"weights": {"Q4_1": layer_weights}, "held_in": "int4/g32"}] * 2 + [None]
    lines = format_eval_report(report).splitlines()
    said = [line for line in lines if "stored 4-bit blocks as they are" in line]
    assert [line.split(":")[0] for line in said] == ["int8", "int4/g32"]
    assert f"{layer_weights} Q4_1 layer weights" in said[0] and "int4/g32" in said[0]


@pytest.mark.parametrize(("block_type", "scheme"), [
    (GGMLQuantizationType.Q8_0, "int8"), (GGMLQuantizationType.Q4_1, "none"), (GGMLQuantizationType.Q4_1, "int4/g64"),
], ids=["q8_0-int8", "q4_1-none", "q4_1-int4-g64"])
def test_no_weight_is_held_as_stored_where_the_scheme_rounds_them_itself(tiny_gguf, block_type, scheme):
    path, _ = tiny_gguf("llama", block_type)
    assert weights_held_as_stored(path, scheme, device=torch.device("cpu")) == {}
