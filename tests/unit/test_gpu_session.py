"""scripts/gpu_session.sh has not drifted from the code it runs: every command of every stage, as the script prints it
(HEARTH_GPU_PRINT), parses with the CLI's or the script's own parser, names files and random shapes that exist, and
the wheels its header fetches cover what those commands import beyond the GPU machine's image. A lent GPU comes with
15 minutes of device time; a stale option would spend them."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer.main
from typer import _click as click

from hearth.services.cli import app
from hearth.services.devtools.random_models import RANDOM_PREFIX, RANDOM_SHAPES

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"
# What the GPU machine's image holds and the wheels must not replace (../shared/gpu/README.md): its CUDA torch and
# the transformers stack built against it.
IMAGE_DISTRIBUTIONS = {"torch", "transformers", "safetensors", "tokenizers", "numpy"}
# Imported only where the GPU machine never goes: tests/conftest.py's NATS in a container, where Docker runs.
NEVER_ON_THE_GPU_MACHINE = {"testcontainers"}
BENCH = typer.main.get_command(app).get_command(click.Context(typer.main.get_command(app)), "bench")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the script is a bash script")


def stage_names() -> list[str]:
    return re.findall(r"^  ([a-z0-9-]+)\)$", SCRIPT.read_text(encoding="utf-8"), flags=re.MULTILINE)


def printed_commands(tmp_path: Path, stages: list[str]) -> list[list[str]]:
    """The commands `stages` run, as HEARTH_GPU_PRINT prints them (nothing runs)."""
    environment = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HEARTH_GPU_PRINT": "1"}
    result = subprocess.run(["bash", str(SCRIPT), *stages], cwd=ROOT, env=environment, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [shlex.split(line.removeprefix("run: ")) for line in result.stdout.splitlines() if line.startswith("run: ")]


def parsed_script_arguments(script: Path, arguments: list[str]) -> argparse.Namespace:
    """`arguments` parsed by the script's own parser: its main() runs until parse_args has returned, then stops."""

    class Parsed(Exception):
        pass

    real_parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        raise Parsed(real_parse_args(parser, args, namespace))

    name = f"gpu_session_{script.stem}"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, name, module)  # dataclasses look their module up while the script loads
        spec.loader.exec_module(module)
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        patch.setattr(sys, "argv", [str(script), *arguments])
        with pytest.raises(Parsed) as parsed:
            module.main()
    return parsed.value.args[0]


def check_bench_arguments(arguments: list[str]) -> None:
    try:
        BENCH.make_context("bench", list(arguments))
    except click.exceptions.ClickException as error:
        pytest.fail(f"hearth bench {shlex.join(arguments)}: {error.format_message()}")
    check_random_shapes(arguments)


def check_random_shapes(arguments: list[str]) -> None:
    for argument in arguments:
        if argument.startswith(RANDOM_PREFIX):
            assert argument.removeprefix(RANDOM_PREFIX) in RANDOM_SHAPES, f"no random shape {argument}"


def check_inline_code(code: str, arguments: list[str]) -> None:
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            assert all(hasattr(module, alias.name) for alias in node.names), f"{node.module} lacks a name of {code!r}"
    assert all(shape in RANDOM_SHAPES for shape in arguments), arguments


def check_pytest_arguments(arguments: list[str]) -> None:
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"][
        "markers"]
    assert arguments[arguments.index("-m") + 1] in {marker.split(":")[0] for marker in markers}
    test_files = [argument for argument in arguments if argument.endswith(".py")]
    assert test_files, arguments
    for test_file in test_files:
        assert "mark.cuda" in (ROOT / test_file).read_text(encoding="utf-8"), f"{test_file} has no CUDA tests"


@pytest.mark.parametrize("stage", stage_names())
def test_every_command_of_a_stage_parses(stage, tmp_path):
    commands = printed_commands(tmp_path, [stage])
    assert commands, f"stage {stage} runs nothing"
    for argv in commands:
        match argv[1:]:
            case ["-m", "hearth.services.cli", "bench", *arguments]:
                check_bench_arguments(arguments)
            case ["-m", "pytest", *arguments]:
                check_pytest_arguments(arguments)
            case ["-c", code, *arguments]:
                check_inline_code(code, arguments)
            case [script, *arguments] if script.startswith("scripts/") and script.endswith(".py"):
                options = parsed_script_arguments(ROOT / script, arguments)
                check_random_shapes(arguments)
                if script == "scripts/profile_bench.py":
                    check_bench_arguments(options.bench_args[1:] if options.bench_args[:1] == ["--"] else
                                          options.bench_args)
            case _:
                pytest.fail(f"stage {stage}: a command this test does not know how to check: {shlex.join(argv)}")


def test_the_checks_find_what_is_not_there():
    with pytest.raises(pytest.fail.Exception):
        check_bench_arguments(["--model", "random:tiny", "--no-such-option"])
    with pytest.raises(AssertionError):
        check_bench_arguments(["--model", "random:no-such-shape"])
    with pytest.raises(SystemExit):
        parsed_script_arguments(ROOT / "scripts" / "gpu_probe.py", ["--no-such-option"])
    assert parsed_script_arguments(ROOT / "scripts" / "gpu_probe.py", ["--repeats", "2"]).repeats == 2


def test_a_dry_runs_appended_options_override_the_stages_own():
    """HEARTH_GPU_DRY_RUN appends `--repeats 1 --new-tokens 8` to a stage's bench arguments: the last one counts."""
    context = BENCH.make_context("bench", ["--repeats", "3", "--new-tokens", "64", "--repeats", "1", "--new-tokens",
                                           "8"])
    assert (context.params["repeats"], context.params["new_tokens"]) == (1, 8)


def fetched_wheels() -> set[str]:
    """The requirements the header's fetching lines name (`pip wheel` and `fetch-wheels.sh`, options left out)."""
    header = "\n".join(line.removeprefix("#") for line in SCRIPT.read_text(encoding="utf-8").splitlines()
                       if line.startswith("#"))
    lines = re.findall(r"(?:bash \.\./shared/gpu/fetch-wheels\.sh|python3 -m pip wheel) ((?:.*\\\n)*.*)", header)
    assert len(lines) == 2, lines
    words = shlex.split(" ".join(line.replace("\\\n", " ") for line in lines))
    option_values = {index + 1 for index, word in enumerate(words) if word in {"--platform", "-w"}}
    return {word.replace(" ", "") for index, word in enumerate(words)
            if not word.startswith("-") and index not in option_values}


def distribution(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_wheels_fetched_for_the_gpu_machine_hold_every_dependency_with_its_bounds():
    """A dependency added to pyproject.toml (or a bound raised) reaches the GPU machine, which fetches nothing."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    wanted = {dependency.split(";")[0].replace(" ", "") for dependency in dependencies
              if distribution(dependency) not in IMAGE_DISTRIBUTIONS}
    missing = wanted - fetched_wheels()
    assert not missing, f"scripts/gpu_session.sh's fetch-wheels.sh line lacks {sorted(missing)}"


def test_what_the_stages_python_files_import_is_on_the_gpu_machine(tmp_path):
    """The scripts and test modules the stages run import only the standard library, hearth, the image's packages
    and the fetched wheels (a module importing openai needs openai's wheel)."""
    commands = printed_commands(tmp_path, stage_names())
    files = {ROOT / "tests" / "conftest.py", ROOT / "tests" / "e2e" / "conftest.py"}
    files |= {ROOT / argument for argv in commands for argument in argv
              if argument.endswith(".py") and (ROOT / argument).is_file()}
    owners = importlib.metadata.packages_distributions()
    fetched = {distribution(requirement) for requirement in fetched_wheels()} | IMAGE_DISTRIBUTIONS | {"pytest"}
    missing = {}
    for path in sorted(files):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for top in {name.split(".")[0] for name in names} - set(sys.stdlib_module_names) - {"hearth", "tests"} \
                    - NEVER_ON_THE_GPU_MACHINE:
                if not {distribution(owner) for owner in owners.get(top, [top])} & fetched:
                    missing.setdefault(path.relative_to(ROOT).as_posix(), set()).add(top)
    assert not missing, missing
