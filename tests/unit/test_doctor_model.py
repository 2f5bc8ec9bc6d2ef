"""`hearth doctor --model`: a checkpoint folder or GGUF file hearth serves passes, anything else fails in one line (a
hub id not on this machine is a warning, a `store:NAME` is left to the broker), nothing is written (no GGUF cache),
and a shard host's memory budget is judged as `hearth host` plans it: by the same layer sizes and the same refusal."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from hearth.inference.memory import layer_weight_bytes
from hearth.services.common.config import HearthSettings
from hearth.services.common.hearth_files import data_dir
from hearth.services.doctor.model_checks import _layer_bytes, memory_check, model_source_check

from .gguf_files import own_cache, quantized_iq4_nl, rewrite_gguf, tiny_gguf  # noqa: F401  (fixtures)

TINY = data_dir("models") / "hearth-tiny-llama"
MXFP4 = GGMLQuantizationType.MXFP4


def test_the_bundled_checkpoint_folder_passes_by_its_name_too():
    line, source = model_source_check("hearth-tiny-llama")
    assert line.verdict == "ok" and "a checkpoint folder of 6 layers" in line.detail
    assert source.local is not None and source.local.path == TINY.resolve()


@pytest.mark.parametrize("make,said", [
    (lambda folder: folder, "has no config.json"),
    (lambda folder: (folder / "notes.txt").write_text("hi") and folder / "notes.txt",
     "is neither a checkpoint folder nor a GGUF file"),
    (lambda folder: folder / "gone", "does not exist"),
])
def test_a_path_that_is_no_model_fails_in_one_line(tmp_path, make, said):
    line, source = model_source_check(str(make(tmp_path)))
    assert line.verdict == "fail" and said in line.detail and "\n" not in line.detail
    assert source.local is None


def test_a_hub_id_not_on_this_machine_is_a_warning_and_a_store_model_is_left_to_the_broker():
    line, source = model_source_check("no-such-org/no-such-model")
    assert line.verdict == "warn" and "not on this machine" in line.detail and source.local is None
    line, source = model_source_check("store:tiny")
    assert line is None and source.store_name == "tiny"
    line, _ = model_source_check("store:no/slashes")
    assert line.verdict == "fail" and "model name" in line.detail


def test_a_gguf_is_checked_and_weighed_without_writing_the_gguf_cache(tiny_gguf, tmp_path):
    path, _reference = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    line, source = model_source_check(str(path))
    assert line.verdict == "ok" and "a GGUF file of 6 layers" in line.detail, line
    weighed = _layer_bytes(source, None, torch.float32, _scheme("int8"), torch.device("cpu"))
    assert not (tmp_path / "cache").exists()  # own_cache's folder: the doctor wrote nothing there
    served = layer_weight_bytes(path, torch.float32, quantization="int8")  # through the cached tensor table
    assert weighed == [served[index] for index in range(len(served))]


def test_a_gguf_with_a_layer_in_a_block_type_hearth_does_not_read_fails(tiny_gguf, tmp_path):
    source, _reference = tiny_gguf("llama", GGMLQuantizationType.F32)

    def one_tensor_in_mxfp4(name: str, values: np.ndarray):
        if name != "blk.0.ffn_down.weight":
            return values, None
        return np.zeros(gguf.quant_shape_to_byte_shape(values.shape, MXFP4), dtype=np.uint8), MXFP4

    path = rewrite_gguf(source, tmp_path / "mxfp4.gguf", "llama", one_tensor_in_mxfp4)
    line, source = model_source_check(str(path))
    assert line.verdict == "fail" and source.local is None
    assert "tensor blk.0.ffn_down.weight of mxfp4.gguf is stored as MXFP4" in line.detail


def _scheme(label: str):
    from hearth.inference.quantization import parse_quantization

    return parse_quantization(label)


def test_a_budget_that_holds_no_layer_fails_as_hearth_host_refuses_it():
    _line, source = model_source_check(str(TINY))
    check = memory_check(source, None, HearthSettings(), memory_budget_mb=1, device="cpu", dtype=None, quantize=None)
    assert check.verdict == "fail" and "a memory budget of 1.0 MB holds no layer of" in check.detail
    assert "--memory-budget-mb" in check.fix


def test_a_budget_that_holds_layers_says_how_many():
    _line, source = model_source_check(str(TINY))
    check = memory_check(source, None, HearthSettings(), memory_budget_mb=100, device="cpu", dtype="fp32",
                         quantize="int8")
    assert check.verdict == "ok" and "holds up to 6 of the 6 layers, quantized int8, on cpu" in check.detail


def test_the_default_says_it_weighs_the_layers_as_stored(tiny_gguf):
    path, _ = tiny_gguf("llama", GGMLQuantizationType.Q4_1)
    _line, source = model_source_check(str(path))
    check = memory_check(source, None, HearthSettings(), memory_budget_mb=100, device="cpu", dtype="fp32",
                         quantize=None)
    assert check.verdict == "ok"
    assert "quantized int4/g32 (--quantize auto: the precision its layers are stored in), on cpu" in check.detail


def test_the_memory_line_says_when_int4_rounds_a_files_blocks_again(tiny_gguf, tmp_path):
    source, _ = tiny_gguf("llama", GGMLQuantizationType.F32)

    def in_iq4_nl(name, values):
        if values.ndim != 2 or not name.startswith("blk."):
            return values, None
        return quantized_iq4_nl(values), GGMLQuantizationType.IQ4_NL

    path = rewrite_gguf(source, tmp_path / "iq4_nl.gguf", "llama", in_iq4_nl)
    _line, checked = model_source_check(str(path))
    check = memory_check(checked, None, HearthSettings(), memory_budget_mb=100, device="cpu", dtype="fp32",
                         quantize=None)
    assert check.verdict == "ok" and check.detail.endswith(
        "; its IQ4_NL blocks are rounded again into int4/g32 (no kernel holds them as stored): `hearth eval "
        "--reference` measures what that costs, and a Q4_K_M file of the model is served as stored")
    as_int8 = memory_check(checked, None, HearthSettings(), memory_budget_mb=100, device="cpu", dtype="fp32",
                           quantize="int8")
    assert as_int8.verdict == "ok" and "rounded again" not in as_int8.detail  # int8 keeps the file's quality


def test_a_device_this_machine_lacks_fails_the_memory_check():
    _line, source = model_source_check(str(TINY))
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    check = memory_check(source, None, HearthSettings(), memory_budget_mb=100, device="cuda", dtype=None,
                         quantize=None)
    assert check.verdict == "fail" and "cuda" in check.detail.lower()


def test_no_memory_line_when_the_layers_cannot_be_weighed_here():
    _line, source = model_source_check("no-such-org/no-such-model")
    assert memory_check(source, None, HearthSettings(), memory_budget_mb=100, device="cpu", dtype=None,
                        quantize=None) is None
