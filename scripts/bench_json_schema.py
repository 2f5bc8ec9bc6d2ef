"""Measures how often `response_format` `json_schema` (strict) answers validate against their schema through the
OpenAI-compatible gateway with a random-weight model, which has learnt nothing, so only the grammar keeps its output
valid (issue 30's target: 100 of 100 calls; BENCHMARKS.md, "Constrained output").

A mesh of real processes (nats-server, the model's layers over `--shards` shard hosts, an orchestrator, `hearth
gateway`, as scripts/bench_conversation.py starts it) is driven by the `openai` client, one call at a time, cycling
through strict schemas with nested objects, arrays, enums, patterns and required fields, sampled at temperature 1
with a seed per call so that every call takes another path through its schema. Each answer is validated against
its schema: with `jsonschema` where it is installed, else with the pydantic model the schema is generated from
(strict mode: no coercion). Prints valid/calls and the latency per schema and overall.

    .venv/bin/python scripts/bench_json_schema.py --calls 100
    .venv/bin/python scripts/bench_json_schema.py --calls 100 --model random:llama-250m --json results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_conversation import BenchMesh, model_path  # noqa: E402

try:
    import jsonschema
except ImportError:  # then the pydantic models the schemas are generated from validate
    jsonschema = None

MEMBER = "alice"
PROMPT = "Answer with the JSON object the schema asks for."


class Strict(BaseModel):
    # additionalProperties false, every field required: what OpenAI's strict mode asks of a schema.
    model_config = ConfigDict(extra="forbid")


class Thing(Strict):
    name: Annotated[str, Field(max_length=10)]
    count: Annotated[int, Field(ge=0, le=1000)]
    level: Literal["low", "medium", "high"]


class Address(Strict):
    city: Literal["Paris", "Oslo", "Lima"]
    zip: Annotated[str, Field(pattern=r"^[0-9]{5}$")]


class Person(Strict):
    name: Annotated[str, Field(min_length=1, max_length=16)]
    age: Annotated[int, Field(ge=0, le=150)]
    member: bool
    address: Address


class Task(Strict):
    id: Annotated[int, Field(ge=1, le=99)]
    done: bool
    title: Annotated[str, Field(max_length=12)]


class TodoList(Strict):
    owner: Annotated[str, Field(max_length=12)]
    tasks: Annotated[list[Task], Field(min_length=1, max_length=3)]
    labels: Annotated[list[Literal["home", "work", "urgent"]], Field(max_length=3)]


class Order(Strict):
    status: Literal["open", "paid", "shipped"]
    customer: Person
    lines: Annotated[list[Annotated[int, Field(ge=1, le=9)]], Field(min_length=1, max_length=4)]
    note: Annotated[str, Field(max_length=20)]


SCHEMAS: dict[str, type[Strict]] = {"flat": Thing, "nested": Person, "array of objects": TodoList,
                                    "nested and arrays": Order}


@dataclass
class Answer:
    schema: str
    seed: int
    latency_ms: float
    finish_reason: str
    completion_tokens: int
    valid: bool
    error: str = ""


def validator(model: type[Strict]):
    """A function that returns None when a text validates against `model`'s JSON schema, else why not."""
    schema = model.model_json_schema()

    def check(text: str) -> str | None:
        if jsonschema is not None:
            try:
                jsonschema.validate(json.loads(text), schema)
            except (ValueError, jsonschema.ValidationError) as error:
                return str(error).splitlines()[0]
            return None
        try:
            model.model_validate_json(text, strict=True)
        except ValidationError as error:
            return str(error).replace("\n", " ")[:200]
        return None

    return check


def run_calls(mesh: BenchMesh, calls: int, max_tokens: int, temperature: float, seed: int) -> list[Answer]:
    client = mesh.client(MEMBER)
    checks = {name: validator(model) for name, model in SCHEMAS.items()}
    answers = []
    for index in range(calls):
        name = list(SCHEMAS)[index % len(SCHEMAS)]
        model = SCHEMAS[name]
        response_format = {"type": "json_schema", "json_schema": {
            "name": model.__name__, "schema": model.model_json_schema(), "strict": True}}
        started = time.perf_counter()
        completion = client.chat.completions.create(
            model=mesh.model.name, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens,
            temperature=temperature, seed=seed + index, response_format=response_format)
        latency_ms = 1000 * (time.perf_counter() - started)
        choice = completion.choices[0]
        error = checks[name](choice.message.content or "")
        tokens = completion.usage.completion_tokens if completion.usage else -1
        answers.append(Answer(name, seed + index, latency_ms, choice.finish_reason, tokens, error is None,
                              error or ""))
        print(f"  #{index + 1} {name}: {'valid' if error is None else 'INVALID ' + error} "
              f"({choice.finish_reason}, {latency_ms:.0f} ms) {choice.message.content}", file=sys.stderr, flush=True)
    return answers


def report(answers: list[Answer]) -> str:
    lines = ["| schema | valid / calls | median latency ms | max latency ms | median answer tokens |",
             "|---|---|---|---|---|"]
    groups = {name: [a for a in answers if a.schema == name] for name in SCHEMAS}
    groups["all"] = answers
    for name, group in groups.items():
        if not group:
            continue
        latencies = [a.latency_ms for a in group]
        lines.append(f"| {name} | {sum(a.valid for a in group)} / {len(group)} | {statistics.median(latencies):.0f} "
                     f"| {max(latencies):.0f} | {statistics.median(a.completion_tokens for a in group):.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--model", default="random:tiny", help="a random:<shape> or a checkpoint folder")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=400,
                        help="per call; every schema's output is bounded well below it")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=30, help="call i samples with seed + i")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write every call's result here")
    options = parser.parse_args()
    with BenchMesh(model_path(options.model), options.shards, [MEMBER], {}, options.work_dir) as mesh:
        answers = run_calls(mesh, options.calls, options.max_tokens, options.temperature, options.seed)
    print(report(answers))
    valid = sum(a.valid for a in answers)
    print(f"\n{valid} of {len(answers)} answers valid ({options.model}, {options.shards} shards, temperature "
          f"{options.temperature}); validated with {'jsonschema' if jsonschema else 'pydantic, strict'}")
    if options.json:
        options.json.write_text(json.dumps([asdict(a) for a in answers], indent=1))
    sys.exit(0 if valid == len(answers) else 1)


if __name__ == "__main__":
    main()
