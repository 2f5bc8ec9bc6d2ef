"""`--quantize` and `[research.distributed_inference.host] quantize`: resolution, one-line refusals, and a host's
coverage counting only replicas of its own scheme."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from hearth.services.cli import app
from hearth.services.common.config import HostSettings
from hearth.inference.memory import layer_weight_bytes
from hearth.inference.quantization import DEFAULT_INT4_GROUP_SIZE, INT4_GROUP_SIZES
from hearth.protocol import quantization_labels as labels
from hearth.services.host.planner import choose_range, replicas_per_layer
from hearth.services.shard.main import ShardRefused, quantize_setting, resolve_quantization
from tests.unit.inference_tiny_models import write_tiny_model
from tests.unit.test_router_quantization import candidate

CPU = torch.device("cpu")


def test_the_flag_wins_over_the_host_setting_which_defaults_to_auto():
    assert quantize_setting(None, HostSettings(), CPU) == "auto"
    assert quantize_setting(None, HostSettings(quantize="int8"), CPU) == "int8"
    assert quantize_setting("int4", HostSettings(quantize="int8"), CPU) == "int4"
    assert resolve_quantization("int4", (), CPU).label == f"int4/g{DEFAULT_INT4_GROUP_SIZE}"


@pytest.mark.parametrize(("value", "named"), [("int3", "'int3'"), ("int4/g7", "group size 7"), ("fp8", "'fp8'")])
def test_a_bad_scheme_is_one_line_naming_the_option(value, named):
    with pytest.raises(ShardRefused) as refused:
        quantize_setting(value, HostSettings(), CPU)
    message = str(refused.value)
    assert message.startswith("--quantize: ") and named in message and "\n" not in message


def test_a_scheme_without_a_kernel_on_the_device_is_refused():
    with pytest.raises(ShardRefused, match="--quantize: .*mps"):
        quantize_setting("int8", HostSettings(), torch.device("mps"))


def test_the_config_key_refuses_a_malformed_scheme():
    with pytest.raises(ValidationError, match="quantize"):
        HostSettings(quantize="int3")


def test_the_group_sizes_checked_without_torch_are_those_the_kernels_serve():
    assert labels.INT4_GROUP_SIZES == INT4_GROUP_SIZES


def test_the_config_key_refuses_a_group_size_no_kernel_serves():
    with pytest.raises(ValidationError, match="int4 group size 16 is not one of 32, 64, 128, 256"):
        HostSettings(quantize="int4/g16")
    assert HostSettings(quantize="int4/g128").quantize == "int4/g128"


@pytest.mark.parametrize("command", [["shard", "--model", "m", "--layers", "0-1"], ["host", "--model", "m"],
                                     ["orchestrator"], ["demo"], ["bench"], ["eval", "--model", "m"]],
                         ids=lambda command: command[0])
@pytest.mark.parametrize("label", ["int3", "INT8", "int4/g64 ", "int8\n"])
def test_every_command_refuses_a_malformed_scheme_alike_before_starting_anything(command, label):
    result = CliRunner().invoke(app, [*command, "--quantize", label])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '--quantize': {label!r} names no scheme: expected auto, none, int8, int4 or " \
           "int4/gN" in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", [["shard", "--model", "m", "--layers", "0-1"], ["host", "--model", "m"],
                                     ["orchestrator"], ["demo"], ["bench"], ["eval", "--model", "m"]],
                         ids=lambda command: command[0])
@pytest.mark.parametrize("label", ["int4/g16", "int4/g48", "int4/g512"])
def test_every_command_refuses_a_group_size_no_kernel_serves_before_starting_anything(command, label):
    """A well-formed label of a group size without a kernel was let through to the shards a demo or bench starts,
    each then refusing it after the broker and the projector had started."""
    result = CliRunner().invoke(app, [*command, "--quantize", label])
    assert result.exit_code == 2, result.output
    group = label.partition("/g")[2]
    assert f"int4 group size {group} is not one of 32, 64, 128, 256" in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


def test_a_hosts_coverage_counts_only_replicas_of_its_scheme():
    shards = [candidate(0, 3, "int8", "a"), candidate(0, 7, "none", "b"), candidate(4, 7, "int8", "c")]
    count = dict(total_layers=8, weights_sha256=shards[0].weights_sha256, alive=lambda shard: True)
    assert replicas_per_layer(shards, **count) == [1] * 8
    assert replicas_per_layer(shards, quantization="int8", **count) == [1] * 8
    assert replicas_per_layer(shards, quantization="int4/g64", **count) == [0] * 8
    assert replicas_per_layer(shards[:2], quantization="int8", **count) == [1, 1, 1, 1, 0, 0, 0, 0]


def test_a_budget_takes_about_four_times_the_layers_in_int8(tmp_path):
    path = write_tiny_model(tmp_path / "deep", "llama", with_tokenizer=False, num_hidden_layers=16)

    def layers_within(budget_bytes: int, scheme: str) -> int:
        per_layer = layer_weight_bytes(path, torch.float32, quantization=scheme)
        chosen = choose_range([0] * 16, [per_layer[index] for index in range(16)], budget_bytes)
        return chosen.hi - chosen.lo + 1

    fp32_two_layers = sum(layer_weight_bytes(path, torch.float32)[index] for index in (0, 1))
    assert layers_within(fp32_two_layers, "none") == 2
    assert layers_within(fp32_two_layers, "int8") >= 7
