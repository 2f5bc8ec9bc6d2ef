"""`hearth eval` end to end on tiny random models: the JSON report's figures are sane, full precision against itself
measures no difference, and bad input (a GGUF in a block type hearth does not read included) is one line with exit
code 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from typer.testing import CliRunner

from hearth.services.cli import app
from hearth.services.common.hearth_files import data_dir
from hearth.formats.cache_layout import WEIGHTS_CACHE_DIR_ENV as CACHE_DIR_ENV
from tests.unit.gguf_files import rewrite_gguf, write_tiny_gguf
from tests.unit.inference_tiny_models import one_torch_thread, write_tiny_model  # noqa: F401  (fixture by name)

pytestmark = pytest.mark.integration

SAMPLE_TEXT = Path(__file__).resolve().parents[1] / "data" / "eval_sample.txt"
MXFP4 = GGMLQuantizationType.MXFP4  # a block type gguf.quants knows and hearth does not read
REPORT_KEYS = {"model", "reference", "text", "token_source", "context_tokens", "windows", "positions",
               "reference_dtype", "reference_perplexity", "schemes"}
SCHEME_KEYS = {"scheme", "mean_kl_nats", "max_kl_nats", "top1_agreement", "perplexity", "bits_per_weight",
               "held_as_stored", "kept_precise", "rounded_again"}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("eval-model"), "llama")


@pytest.fixture(scope="module")
def random_cache(tmp_path_factory) -> dict:
    """The environment that writes `random:<shape>` checkpoints once, to a folder of this module's."""
    return {CACHE_DIR_ENV: str(tmp_path_factory.mktemp("random-models"))}


def run_eval(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, ["eval", *args], env=env)


def test_int8_against_float32_reports_sane_figures_as_json(tiny_llama):
    result = run_eval("--model", str(tiny_llama), "--text", str(SAMPLE_TEXT), "--quantize", "int8",
                      "--context-tokens", "32", "--max-tokens", "100", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) == REPORT_KEYS
    assert report["token_source"] == "tokenizer" and report["reference_dtype"] == "float32"
    assert report["windows"] == 4 and report["positions"] == 100 - report["windows"]
    assert [row["scheme"] for row in report["schemes"]] == ["int8"]
    row = report["schemes"][0]
    assert set(row) == SCHEME_KEYS
    assert 0.0 <= row["mean_kl_nats"] <= row["max_kl_nats"]
    assert 0.0 <= row["top1_agreement"] <= 1.0
    assert math.isfinite(report["reference_perplexity"]) and report["reference_perplexity"] > 1.0
    assert math.isfinite(row["perplexity"]) and row["perplexity"] > 1.0


def test_a_random_shape_reads_bytes_and_full_precision_matches_itself(random_cache):
    result = run_eval("--model", "random:tiny", "--text", str(SAMPLE_TEXT), "--quantize", "none",
                      "--quantize", "int4/g32", "--context-tokens", "64", "--max-tokens", "128",
                      env=random_cache)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "(utf8_bytes): 126 positions in 2 windows" in lines[0]
    assert lines[3].split()[:4] == ["none", "0.000000", "0.0000", "100.00"]
    assert lines[4].split()[0] == "int4/g32"


def test_without_a_text_it_reads_the_design_document_hearth_ships(random_cache):
    result = run_eval("--model", "random:tiny", "--quantize", "none", "--context-tokens", "32", "--max-tokens", "64",
                      "--json", env=random_cache)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert Path(report["text"]) == data_dir("docs") / "design.md"
    assert report["windows"] == 2 and report["positions"] == 62  # the text had the 64 tokens asked for
    assert "hearth's own docs/design.md" in " ".join(run_eval("--help").stdout.split())


@pytest.mark.parametrize(("args", "named"), [
    (["--quantize", "int4/g128"], "--quantize int4/g128: "),  # the tiny model's 64 inputs take no group of 128
    (["--text", "/nonexistent/text.txt"], "no such file"),
    (["--context-tokens", "100000"], "more than the model's 256 positions"),
    (["--model", "random:no-such-shape"], "unknown random shape"),
])
def test_bad_input_is_one_line_and_exit_code_2(tiny_llama, args, named):
    result = run_eval("--model", str(tiny_llama), "--text", str(SAMPLE_TEXT), *args)
    assert result.exit_code == 2, result.output
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("hearth eval: ") and named in message
    assert "Traceback" not in result.output


def test_a_gguf_file_is_evaluated_and_the_help_says_it_may_be_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = write_tiny_gguf(tmp_path, "llama", GGMLQuantizationType.F32)
    result = run_eval("--model", str(path), "--text", str(SAMPLE_TEXT), "--quantize", "int8", "--max-tokens", "16",
                      "--json")
    assert result.exit_code == 0, result.output
    assert [row["scheme"] for row in json.loads(result.stdout)["schemes"]] == ["int8"]
    assert "GGUF file" in " ".join(run_eval("--help").stdout.split())


def test_a_gguf_in_a_block_type_hearth_does_not_read_is_bad_input(tmp_path, monkeypatch):
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))  # its parsed metadata, not in the user's cache
    source, _ = write_tiny_gguf(tmp_path, "llama", GGMLQuantizationType.F32)

    def one_tensor_in_mxfp4(name: str, values: np.ndarray):
        if name != "blk.0.ffn_down.weight":
            return values, None
        return np.zeros(gguf.quant_shape_to_byte_shape(values.shape, MXFP4), dtype=np.uint8), MXFP4

    path = rewrite_gguf(source, tmp_path / "mxfp4.gguf", "llama", one_tensor_in_mxfp4)
    result = run_eval("--model", str(path), "--text", str(SAMPLE_TEXT), "--max-tokens", "16")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1] == (
        "hearth eval: tensor blk.0.ffn_down.weight of mxfp4.gguf is stored as MXFP4, a GGUF type hearth does not "
        "read (it reads F32, F16, BF16, F64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ1_S, "
        "IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS)")
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("content", "named"), [(b"\xff\xfe text", "not UTF-8"), (b"", "empty"),
                                                (b"x", "fewer than 2 tokens")])
def test_unusable_texts_exit_with_code_2(tmp_path, random_cache, content, named):
    text = tmp_path / "text.txt"
    text.write_bytes(content)
    # A random shape reads bytes: one byte is one token.
    result = run_eval("--model", "random:tiny", "--text", str(text), env=random_cache)
    assert result.exit_code == 2, result.output
    assert named in result.stderr and "Traceback" not in result.output
