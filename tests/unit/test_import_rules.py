"""The dependency rules of docs/design.md §1, enforced: what each package may import, no torch in the light
processes, no import cycles.

Each check fails naming the offending module and import:

- statically, every import statement (module level, inside functions, under TYPE_CHECKING) of every ``.py`` under
  the project's packages against the allow-list ALLOWED_IMPORTS (every module belongs to one entry: a new package
  must say what it may import) and the third-party bans of THIRD_PARTY_BANS;
- at runtime, in a fresh interpreter, importing every module of the light packages leaves torch and transformers
  out of ``sys.modules``;
- the graph of all imports among the project's modules, deferred ones included (a function's import runs when it is
  called, and a cycle through one is still a circle to read through), has no cycle.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.unit.import_graph import (
    ALL_IMPORTS,
    MODULES,
    PACKAGES,
    ROOT,
    imports_of,
    shortest_cycle,
    strongly_connected,
    under,
)

HEAVY_MODULES = ("torch", "transformers")
_FOUNDATIONS = ("protocol", "trust")
_BROKER_SIDE = (*_FOUNDATIONS, "events", "services.common", "services.broker")
_MODEL_SIDE = (*_BROKER_SIDE, "formats", "inference", "services.transport", "services.weights_store")

# What each package (or top-level module) may import of the project besides itself: the architecture, bottom up.
# The dev tooling (services.devtools) may use everything; only the CLI entry may import it, lazily.
ALLOWED_IMPORTS: dict[str, tuple[str, ...]] = {
    "trust": (),
    "protocol": (),
    "formats": (),
    "inference": ("formats",),
    "events": _FOUNDATIONS,
    "readmodels": (*_FOUNDATIONS, "events"),
    "services": (),
    "services.common": (*_FOUNDATIONS, "events"),
    "services.broker": _BROKER_SIDE,
    "services.client": _BROKER_SIDE,
    "services.transport": _BROKER_SIDE,
    "services.weights_store": (*_BROKER_SIDE, "formats", "inference", "services.weights_objects"),
    "services.weights_objects": (*_BROKER_SIDE, "inference"),
    "services.weights_publish": (*_BROKER_SIDE, "formats", "inference", "services.weights_store",
                                 "services.weights_objects"),
    "services.schema": _BROKER_SIDE,
    "services.cli_options": _BROKER_SIDE,
    "services.model_options": _FOUNDATIONS,
    "services.cli_errors": (),
    "services.shard": (*_MODEL_SIDE, "services.cli_options"),
    "services.orchestrator": (*_MODEL_SIDE, "readmodels"),
    "services.projector": (*_BROKER_SIDE, "readmodels", "services.cli_options", "services.cli_errors"),
    "services.replay": (*_BROKER_SIDE, "readmodels", "services.cli_options", "services.cli_errors"),
    "services.dashboards": (*_BROKER_SIDE, "readmodels", "services.cli_options"),
    "services.gateway": (*_BROKER_SIDE, "services.client", "services.cli_options"),
    "services.host": (*_MODEL_SIDE, "readmodels", "services.cli_options", "services.model_options",
                      "services.shard", "services.orchestrator"),
    "services.community_cli": (*_BROKER_SIDE, "services.cli_options", "services.gateway",
                               "services.community_cli_options", "services.community_broker_cli",
                               "services.community_cli_messages", "services.community_reputation",
                               "services.community_removal", "services.community_rotation",
                               "services.community_addition", "services.community_pending",
                               "services.community_pending_cli"),
    "services.community_cli_options": (),
    "services.community_cli_messages": ("trust", "services.community_cli_options", "services.community_removal"),
    "services.community_broker_cli": (*_BROKER_SIDE, "services.cli_options", "services.gateway",
                                      "services.community_cli_options"),
    "services.community_reputation": _BROKER_SIDE,
    "services.community_removal": _BROKER_SIDE,
    "services.community_rotation": (*_BROKER_SIDE, "services.community_removal", "services.community_pending"),
    "services.community_addition": (*_BROKER_SIDE, "services.community_removal"),
    "services.community_pending": (*_BROKER_SIDE, "services.community_removal", "services.community_addition"),
    "services.community_pending_cli": (*_BROKER_SIDE, "services.cli_options", "services.community_cli_options",
                                       "services.community_cli_messages", "services.community_pending",
                                       "services.community_removal"),
    "services.nats_cli": (*_BROKER_SIDE, "services.cli_options"),
    "services.db_cli": (*_BROKER_SIDE, "readmodels", "services.cli_options"),
    "services.cache_inventory": ("formats", "inference"),  # inference only to remove store and hub versions
    "services.cache_cli": ("formats", "services.cli_options", "services.cache_inventory"),
    "services.weights_cli": (*_BROKER_SIDE, "services.cli_options", "services.weights_store",
                             "services.weights_publish"),
    "services.devtools": (*_MODEL_SIDE, "readmodels", "services.cli_options", "services.model_options",
                          "services.client", "services.gateway",
                          "services.shard", "services.orchestrator", "services.projector", "services.host"),
    # `hearth doctor` checks what each serving command would load, with their own functions.
    "services.doctor": (*_MODEL_SIDE, "services.cli_options", "services.model_options", "services.client",
                        "services.gateway", "services.shard", "services.host"),
    "services.cli": ("*",),  # the entry point: every command's module, each loaded when its command runs
}

# Third-party modules a package must never import (light processes, and the layers that must not talk to NATS).
THIRD_PARTY_BANS: dict[str, tuple[str, ...]] = {
    "trust": ("torch", "nats"),
    "protocol": ("torch", "transformers", "nats"),
    "formats": ("torch", "transformers", "nats"),
    "inference": ("nats",),
    "events": ("torch",),
    "readmodels": ("torch",),
    "services.replay": ("torch",),
    "services.projector": ("torch",),
    "services.common": ("torch", "transformers"),
}

# Modules whose whole import must leave torch and transformers unloaded (they start fast, run where no model is).
LIGHT_PACKAGES = ("events", "formats", "protocol", "readmodels", "services.broker", "services.client",
                  "services.common", "services.projector", "services.replay", "trust")
# `hearth demo`'s parent describes a GGUF with the header parser every shard runs (inference's package imports its
# names lazily for this) and keeps it in the GGUF cache, all before it starts anything.
LIGHT_MODULES = ("services.cli", "services.devtools.demo_model", "inference.gguf_header", "inference.gguf_cache",
                 "inference.ollama_models")


def owner(module: str) -> str | None:
    """The ALLOWED_IMPORTS entry a module belongs to: the longest one it is under."""
    entries = [entry for entry in ALLOWED_IMPORTS if under(module, entry)]
    return max(entries, key=len) if entries else None


def breaks_allow_list(module: str, target: str) -> bool:
    """Whether `module` importing the project module `target` is outside its package's allow-list."""
    mine, theirs = owner(module), owner(target)
    allowed = ALLOWED_IMPORTS[mine]
    return theirs != mine and "*" not in allowed and not any(under(target, entry) for entry in allowed)


def project_target(target: str) -> str | None:
    """The project module an import names (a name imported from a module resolves to that module), or None."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def test_the_scan_sees_the_project_and_its_deferred_imports():
    assert {"inference", "events", "protocol.subjects", "services.common.config", "services.transport.frames",
            "services.devtools.bench.cli"} <= set(MODULES)
    assert any(found.module == "services.cli" and not found.top_level for found in ALL_IMPORTS)


def test_the_collector_resolves_relative_imports_and_defers_functions_and_type_checking(tmp_path):
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import frames\n"
        "from .errors import FrameError\n"
        "if TYPE_CHECKING:\n    import torch\n"
        "def later():\n    import inference.runner\n"
    )
    path = tmp_path / "module.py"
    path.write_text(source)
    found = {(item.target, item.top_level) for item in imports_of("services.transport.sender", path)}
    assert found == {
        ("typing", True),
        ("services.transport.frames", True),
        ("services.transport.errors", True),
        ("torch", False),
        ("inference.runner", False),
    }


def test_every_module_belongs_to_an_allow_list_entry():
    assert not [module for module in MODULES if owner(module) is None], "add the new package to ALLOWED_IMPORTS"
    assert set(ALLOWED_IMPORTS) - {"*"} >= {entry for allowed in ALLOWED_IMPORTS.values() for entry in allowed} - {"*"}


def test_no_module_imports_outside_its_allow_list():
    offences = []
    for found in ALL_IMPORTS:
        target = project_target(found.target)
        if target is not None and breaks_allow_list(found.module, target):
            when = "" if found.top_level else " (deferred)"
            offences.append(f"{found.path.relative_to(ROOT)}:{found.line}: {found.module} ({owner(found.module)}) "
                            f"imports {target}{when}")
    assert not offences, "imports outside ALLOWED_IMPORTS:\n" + "\n".join(offences)


def test_the_allow_list_check_refuses_a_layer_breach_and_the_tooling_from_production():
    assert breaks_allow_list("services.common.config", "services.broker.connection")
    assert breaks_allow_list("services.shard.hops", "services.orchestrator.chain")
    assert breaks_allow_list("services.orchestrator.pipeline", "services.devtools.local_cluster")
    assert not breaks_allow_list("services.cli", "services.devtools.demo")
    assert not breaks_allow_list("services.shard.hops", "protocol.subjects")


@pytest.mark.parametrize("package", sorted(THIRD_PARTY_BANS))
def test_no_package_imports_a_banned_library(package: str):
    banned = THIRD_PARTY_BANS[package]
    offences = [f"{found.path.relative_to(ROOT)}:{found.line}: {found.module} imports {found.target}"
                for found in ALL_IMPORTS
                if under(found.module, package) and any(under(found.target, name) for name in banned)]
    assert not offences, f"{package} must never import {', '.join(banned)}:\n" + "\n".join(offences)


_PROBE = r"""
import importlib, json, sys, traceback

heavy = tuple(sys.argv[1].split(","))
packages = tuple(sys.argv[2].split(","))
modules = sys.argv[3:]
chains = []


class Watch:
    # Notes which project code asked for a heavy module the first time; never finds anything itself.
    def find_spec(self, fullname, path=None, target=None):
        if fullname in heavy and not chains:
            chain = []
            frame = sys._getframe(1)
            while frame is not None:
                name = frame.f_globals.get("__name__", "").removeprefix("hearth.")
                if name.split(".")[0] in packages:
                    code = frame.f_code.co_name
                    chain.append(name if code == "<module>" else f"{name}.{code}()")
                frame = frame.f_back
            chains.append(list(reversed(chain)))
        return None


sys.meta_path.insert(0, Watch())
for index, module in enumerate(modules):
    chains.clear()
    try:
        importlib.import_module("hearth." + module)
    except BaseException as error:
        print(json.dumps({"index": index, "error": "".join(traceback.format_exception_only(error)).strip()}))
        sys.exit(0)
    loaded = [name for name in heavy if name in sys.modules]
    if loaded:
        print(json.dumps({"index": index, "loaded": loaded, "chain": chains[0] if chains else []}))
        sys.exit(0)
print(json.dumps({"index": len(modules)}))
"""


def light_modules() -> list[str]:
    return [
        module
        for module in MODULES
        if any(under(module, package) for package in LIGHT_PACKAGES) or module in LIGHT_MODULES
    ]


def test_the_light_processes_never_load_torch_or_transformers():
    """One interpreter imports the light modules in turn; one that loads a heavy module is reported with the chain
    of project modules that led there, and the rest are checked in a fresh interpreter."""
    modules = light_modules()
    assert "services.projector.main" in modules and "services.replay.cli" in modules
    offences = []
    start = 0
    while start < len(modules):
        result = subprocess.run(
            [sys.executable, "-c", _PROBE, ",".join(HEAVY_MODULES), ",".join(PACKAGES), *modules[start:]],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout.strip().splitlines()[-1])
        index = start + report["index"]
        if index >= len(modules):
            break
        if "error" in report:
            offences.append(f"import {modules[index]} failed, so it could not be checked: {report['error']}")
        else:
            chain = " -> ".join(report["chain"]) or modules[index]
            offences.append(f"import {modules[index]} loads {', '.join(report['loaded'])} (via {chain})")
        start = index + 1
    assert not offences, "\n".join(offences)


def import_graph() -> dict[str, set[str]]:
    """Every import among the project's own modules, deferred ones included."""
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for found in ALL_IMPORTS:
        target = project_target(found.target)
        if target is not None and target != found.module:
            graph[found.module].add(target)
    return graph


def test_the_cycle_finder_reports_a_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    cycles = [component for component in strongly_connected(graph) if len(component) > 1]
    assert cycles == [["a", "b", "c"]]
    assert shortest_cycle(graph, cycles[0]) == ["a", "b", "c", "a"]


def test_no_import_cycles():
    graph = import_graph()
    cycles = [
        " -> ".join(shortest_cycle(graph, component))
        for component in strongly_connected(graph)
        if len(component) > 1
    ]
    assert not cycles, "import cycles (deferred imports included):\n" + "\n".join(cycles)


def test_the_inference_package_exports_every_name_it_lists_from_its_module():
    """hearth.inference imports its names when first used: each one it lists resolves, to the object its module
    defines, and nothing it lists is missing from the map that says where each lives."""
    import importlib

    import hearth.inference as inference

    assert sorted(inference.__all__) == sorted(inference._EXPORTED_FROM)
    for name, module in inference._EXPORTED_FROM.items():
        assert getattr(inference, name) is getattr(importlib.import_module(module, "hearth.inference"), name)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        inference.not_a_name  # noqa: B018
