"""The package's imports run one way: every import of a ``vllm_ext`` module, at module level or
inside a function, goes to the same layer or to a lower one, and no group of modules imports itself in
a circle. A new upward import fails here with the two modules named. Generic code names no method:
only the registry and the methods' own packages import a method's modules.

Layers, lowest first:
0. base: metrics, counters and small shared helpers every layer uses (``method_kv_spec``,
   ``method_cache_layer``: what the methods' KV-cache specs and cache holders share;
   ``config_fields``: what every configuration section shares), and each method's configuration
   section (``methods.<method>.config``: the method owns it, the configuration reads it);
1. kernels: Triton kernels and their PyTorch twins, on tensors and scalars; they know no method;
2. ``request_state``, ``method_slots`` and ``methods.protocol``: the generic per-request slot table
   and what the backend asks of a method; they know no method;
3. methods: ``methods.sfi``, ``methods.speed``, ``methods.critiprefill``, each a package on its own
   (no method imports another, and none imports the backend);
4. the registry (``methods.registry``: which methods there are) and the configuration object that
   composes their sections (``config``);
5. ``backend``: the attention backend, its builder, impl and dense path, and the engine's request
   table;
6. vLLM glue: ``vllm_patches`` (the list of vLLM's internals SPEEDSFI changes) is the only way into
   ``runner_hooks`` and ``scheduler_policy``;
7. the package entry point and the tools: ``vllm_ext`` (registration), ``quality``, ``tools``.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "vllm_ext"

LAYERS = [
    ("base", {"vllm_ext.metrics", "vllm_ext.device_counters", "vllm_ext.host_staging",
              "vllm_ext.env_vars", "vllm_ext.method_kv_spec", "vllm_ext.method_cache_layer",
              "vllm_ext.row_counters", "vllm_ext.config_fields",
              # each method's configuration section: its own, read by the configuration object
              "vllm_ext.methods.sfi.config", "vllm_ext.methods.speed.config",
              "vllm_ext.methods.critiprefill.config"}),
    ("kernels", {"vllm_ext.kernels"}),
    ("request_state", {"vllm_ext.request_state", "vllm_ext.method_slots", "vllm_ext.methods"}),
    ("sfi", {"vllm_ext.methods.sfi"}),
    ("speed", {"vllm_ext.methods.speed"}),
    ("critiprefill", {"vllm_ext.methods.critiprefill"}),
    ("registry", {"vllm_ext.methods.registry", "vllm_ext.config"}),
    ("backend", {"vllm_ext.backend"}),
    ("glue", {"vllm_ext.vllm_patches", "vllm_ext.runner_hooks", "vllm_ext.scheduler_policy"}),
    ("top", {"vllm_ext", "vllm_ext.quality", "vllm_ext.tools"}),
]
LEVEL = {"base": 0, "kernels": 1, "request_state": 2, "sfi": 3, "speed": 3, "critiprefill": 3,
         "registry": 4, "backend": 5, "glue": 6, "top": 7}
# inside the glue layer, the only entry: vllm_patches -> the others
GLUE_ENTRIES = {("vllm_ext.vllm_patches", "vllm_ext.runner_hooks"),
              ("vllm_ext.vllm_patches", "vllm_ext.scheduler_policy")}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules]
            targets = subs if len(subs) == len(node.names) else [mod] + subs
        else:
            continue
        for t in targets:
            if not t.startswith("vllm_ext"):
                continue
            while t not in modules and "." in t:
                t = t.rpartition(".")[0]
            if t in modules and t != name and not name.startswith(t + "."):
                found.add(t)                      # a package's own parents load first anyway
    return found


def _layer(name: str) -> str:
    best = None
    for layer, prefixes in LAYERS:
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (layer, p)
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best[0]


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer():
    for name in _graph():
        _layer(name)


def test_imports_go_to_the_same_layer_or_down():
    bad = []
    for a, targets in _graph().items():
        ra = _layer(a)
        for b in sorted(targets):
            rb = _layer(b)
            if LEVEL[rb] > LEVEL[ra]:
                bad.append(f"{a} ({ra}) imports {b} ({rb}): upward")
            elif LEVEL[rb] == LEVEL[ra] and ra != rb:
                bad.append(f"{a} ({ra}) imports {b} ({rb}): one method layer into another")
            elif ra == rb == "glue" and a != b and (a, b) not in GLUE_ENTRIES:
                bad.append(f"{a} imports {b}: the glue's only entries are {sorted(GLUE_ENTRIES)}")
    assert not bad, "\n".join(bad)


def test_no_circles():
    graph = _graph()
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_walker_sees_function_level_imports():
    graph = _graph()
    assert "vllm_ext.kernels.sfi_plan" in graph["vllm_ext.methods.sfi.step_plan"]     # imported inside a function


# the only modules outside a method's package that may import it: the registry lists the methods,
# the configuration composes their sections, and the patch list names each vLLM patch with its owner
MAY_NAME_METHODS = {"vllm_ext.methods.registry", "vllm_ext.config", "vllm_ext.vllm_patches"}
METHOD_PACKAGES = ("vllm_ext.methods.sfi", "vllm_ext.methods.speed", "vllm_ext.methods.critiprefill")


def test_generic_code_names_no_method():
    bad = []
    for a, targets in _graph().items():
        if a in MAY_NAME_METHODS or a.startswith(METHOD_PACKAGES) or _layer(a) == "top":
            continue
        for b in sorted(targets):
            if b.startswith(METHOD_PACKAGES):
                bad.append(f"{a} imports {b}")
    assert not bad, "\n".join(bad)
