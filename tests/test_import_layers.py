"""The import graph of the package, read from the source with `ast` (nothing is imported):
subpackages are layered and a module imports only its own layer or lower ones, at module level
or inside a function. Layers, low to high:

    base (config, envs, sampling_params, gc_freeze, gil_switch, request_ids,
      structured_output/constraint.py)
    < core
    < sample, worker, kernels, integrations, lora, spec_decode, structured_output, quantization
      (one layer: they may import each other; the sampler imports nothing from core, the runner
      only core/outputs.py)
    < engine, distributed (rank 0's executor beside the engine; its workers run the engine's
      start-up check)
    < generation
    < entrypoints (the HTTP server)
    < top (hf_paged/__init__.py, hf_paged.testing)

An existing import that breaks the order sits in KNOWN with the reason and the step that removes
it; KNOWN may only shrink (a stale entry fails). core/ importing worker/ or generation/ has no
allow-list at all."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# source directory -> the package it installs as (pyproject's package-dir)
ROOTS = {
    "hf_paged": "hf_paged",
    "kernels": "hf_paged.kernels",
    "integrations": "hf_paged.integrations",
}

BASE, CORE, WORKER, ENGINE, GENERATION, ENTRYPOINTS, TOP = range(7)
LAYER_NAMES = [
    "base",
    "core",
    "sample/worker/kernels/integrations",
    "engine",
    "generation",
    "entrypoints",
    "top",
]
LAYERS = {  # longest prefix wins
    "hf_paged": TOP,
    "hf_paged.testing": TOP,
    "hf_paged.config": BASE,
    "hf_paged.envs": BASE,
    "hf_paged.sampling_params": BASE,
    "hf_paged.gc_freeze": BASE,
    "hf_paged.gil_switch": BASE,
    # sibling ids, torch-free: the server's API process and the engine agree on them
    "hf_paged.request_ids": BASE,
    "hf_paged.core": CORE,
    "hf_paged.sample": WORKER,
    "hf_paged.worker": WORKER,
    "hf_paged.kernels": WORKER,
    "hf_paged.integrations": WORKER,
    "hf_paged.lora": WORKER,
    "hf_paged.spec_decode": WORKER,
    "hf_paged.structured_output": WORKER,
    # a request's constraint is part of its SamplingParams; it imports nothing of hf_paged
    "hf_paged.structured_output.constraint": BASE,
    "hf_paged.quantization": WORKER,
    "hf_paged.engine": ENGINE,
    "hf_paged.distributed": ENGINE,
    "hf_paged.generation": GENERATION,
    "hf_paged.entrypoints": ENTRYPOINTS,
}

# (importer, imported) -> why it is there and which step removes it. Only shrinks.
KNOWN: dict[tuple[str, str], str] = {
    ("hf_paged.integrations.pipeline", "hf_paged.generation.pipelines"): (
        "install() wraps transformers.pipeline so backend='paged' calls hf_paged.pipeline (a lazy"
        " import at call time). Goes when the wrapper moves next to generation/pipelines.py"
        " (integrations/ keeps the model glue)."
    ),
}


def layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise AssertionError(f"{module} belongs to no layer: add its subpackage to LAYERS")


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name."""
    found = {}
    for directory, package in ROOTS.items():
        for path in sorted((REPO / directory).rglob("*.py")):
            parts = list(path.relative_to(REPO / directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known_modules) -> set[str]:
    """The hf_paged modules `name` imports anywhere in its file (relative imports resolved; for
    `from package import x`, the submodule package.x when x is one)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = []
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.append(sub if sub in known_modules else source)
        else:
            continue
        out.update(t for t in targets if t == "hf_paged" or t.startswith("hf_paged."))
    return out


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, found) for name, path in found.items()}


def upward_imports(graph) -> set[tuple[str, str]]:
    return {
        (importer, imported)
        for importer, targets in graph.items()
        for imported in targets
        if layer(imported) > layer(importer)
    }


def test_every_module_has_a_layer():
    for name in modules():
        layer(name)


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "hf_paged.core.scheduler" in graph and "hf_paged.kernels.argmax" in graph
    assert "hf_paged.integrations.transformers" in graph
    assert "hf_paged.core.request" in graph["hf_paged.core.scheduler"]
    # relative imports inside kernels/ resolve to the installed names
    assert "hf_paged.kernels.fused_gemv" in graph["hf_paged.kernels.argmax"]


def test_no_module_imports_a_higher_layer():
    upward = upward_imports(import_graph())
    new = sorted(upward - KNOWN.keys())
    assert not new, (
        "imports of a higher layer ("
        + " < ".join(LAYER_NAMES)
        + "):\n"
        + "\n".join(
            f"  {a} ({LAYER_NAMES[layer(a)]}) imports {b} ({LAYER_NAMES[layer(b)]})" for a, b in new
        )
    )


def test_known_upward_imports_still_exist():
    stale = sorted(KNOWN.keys() - upward_imports(import_graph()))
    assert not stale, f"KNOWN lists imports that are gone (remove them): {stale}"


def test_core_imports_no_worker_and_no_generation():
    bad = sorted(
        (importer, imported)
        for importer, targets in import_graph().items()
        if importer.startswith("hf_paged.core")
        for imported in targets
        if imported.startswith(("hf_paged.worker", "hf_paged.generation"))
    )
    assert not bad, bad


def test_the_sampler_and_the_runner_see_no_request():
    """Data flows one way: the runner and the sampler get plain data (core/outputs.py: the
    ScheduledBatch, NewRequestData) and return plain data; neither imports the scheduler's
    Request, the scheduler or the KV cache manager. The sampler imports nothing from core/."""
    graph = import_graph()
    sample = sorted(
        (importer, imported)
        for importer, targets in graph.items()
        if importer.startswith("hf_paged.sample")
        for imported in targets
        if imported.startswith(("hf_paged.core", "hf_paged.engine", "hf_paged.generation"))
    )
    assert not sample, sample
    worker = sorted(
        (importer, imported)
        for importer, targets in graph.items()
        if importer.startswith("hf_paged.worker")
        for imported in targets
        if imported.startswith("hf_paged.core") and imported != "hf_paged.core.outputs"
    )
    assert not worker, worker
    assert "hf_paged.core.outputs" in graph["hf_paged.worker.model_runner"]


# Sizes: one responsibility per file and class. A file or class over these needs a line on
# evals/RESULTS.md saying why, and an entry here.
MAX_FILE_LINES = 500
MAX_CLASS_LINES = 320  # ~300
LARGER: dict[str, str] = {}


def test_no_file_or_class_is_too_large():
    too_large = []
    for name, path in modules().items():
        source = path.read_text()
        lines = source.count("\n")
        if lines > MAX_FILE_LINES and name not in LARGER:
            too_large.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES and f"{name}.{node.name}" not in LARGER:
                    too_large.append(f"{name}.{node.name}: {size} lines")
    assert not too_large, too_large
