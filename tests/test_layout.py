"""The project's layers, read from the source with `ast`: every import of a project module (at the top of a file or
inside a function) points down the layers or within a layer, never into a cycle; no module passes 700 lines (formatted:
ruff format, which `make lint` checks); only the modules that build the run import Config; losses.py and logprobs.py
import torch (and einops) only. And the presets: runs/cpu.sh writes out every Config field, the others only what
differs from it.

Layers, bottom to top, and why in this order:
- losses, logprobs, moe, lora, parallel, decoder: tensor math, LoRA adapters and their merged weights, the device
  mesh, the embedded engine's model.
- data.rewards, data.guess, data.walk, data.calc, data.rg, data.tasks, sandbox, tools, chat: prompts, environments
  (text and tool ones), rewards, reasoning-gym's tasks, the python tool's sandbox, tool-call parsers and the built-in
  tools, turns rendered with the chat template; no model or engine code, and
  agent.py needs data.rewards (--env shares --reward's plug-in loader), so they sit below the engines.
- rollout: the engine interface (sampling, the rollout records, the protocol) and the weight push.
- embedded_engine, sglang_engine, agent, vine: the two engines, the multi-turn driver and VinePPO's Monte Carlo values,
  all on rollout's interface.
- data.tiny: the default model, warmed up on demonstrations played through agent and the embedded engine.
- checkpoint: the run folder's checkpoints, the lock and the resume checks; it takes options as values (no Config),
  so config, runlog and forward build on it.
- config, runlog, evaluation, value_model, forward, update: the run (options and checks, metrics log and run records,
  held-out evaluation, the critic, the trainer's forwards, the optimiser step).
- build: the run's set-up (its records, the models, make_engine over both engines, the log).
- train_ppo: the loop.

Function-level imports of project modules count like top-level ones: none may point up.
"""

import ast
import dataclasses
import glob
import os
import shlex
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = [
    ("losses", "logprobs", "moe", "lora", "parallel", "decoder"),
    ("data.rewards", "data.guess", "data.walk", "data.calc", "data.rg", "data.tasks", "sandbox", "tools", "chat"),
    ("rollout",),
    ("embedded_engine", "sglang_engine", "agent", "vine"),
    ("data.tiny",),
    ("checkpoint",),
    ("config", "runlog", "evaluation", "value_model", "forward", "update"),
    ("build",),
    ("train_ppo",),
]
LAYER = {m: i for i, layer in enumerate(LAYERS) for m in layer}
MAX_LINES = 700


def path_of(module: str) -> str:
    return os.path.join(REPO, *module.split(".")) + ".py"


def project_modules() -> set[str]:
    """Every module of the project: the .py files at the root and in data/."""
    found = {f[:-3] for f in os.listdir(REPO) if f.endswith(".py")}
    return found | {"data." + f[:-3] for f in os.listdir(os.path.join(REPO, "data")) if f.endswith(".py")}


def imports(module: str) -> list[tuple[str, str | None]]:
    """(imported name, enclosing function or None) for every import statement in the module, at any depth; a
    `from package import name` also yields package.name (a submodule such as data.guess)."""
    found = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Import):
                found.extend((a.name, func) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module != "__future__":
                found.append((child.module, func))
                found.extend((f"{child.module}.{a.name}", func) for a in child.names)
            visit(child, inner)

    with open(path_of(module)) as f:
        visit(ast.parse(f.read()), None)
    return found


def graph(modules) -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    return {m: {name for name, _ in imports(m) if name in modules and name != m} for m in modules}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state, stack = {}, []

    def dfs(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n) :] + [n]
            if n not in state and (cycle := dfs(n)):
                return cycle
        state[m] = "done"
        stack.pop()
        return None

    return next((c for m in sorted(edges) if m not in state and (c := dfs(m))), None)


def upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {n}" for m, ns in edges.items() for n in ns if LAYER[n] > LAYER[m])


def test_every_module_has_a_layer():
    assert project_modules() == set(LAYER), "place each module in LAYERS (and nothing that does not exist)"


def test_no_import_cycle():
    assert find_cycle(graph(project_modules())) is None


def test_imports_point_down_the_layers():
    assert upward(graph(project_modules())) == []


def test_the_checks_catch_a_cycle_and_an_upward_arrow():
    ring = {"rollout": {"agent"}, "agent": {"data.tasks"}, "data.tasks": {"rollout"}}
    assert find_cycle(ring) == ["agent", "data.tasks", "rollout", "agent"]
    assert find_cycle({"rollout": {"losses"}, "agent": {"rollout", "losses"}}) is None
    assert upward({"losses": {"rollout"}, "rollout": {"losses"}}) == ["losses -> rollout"]


def test_no_module_over_700_formatted_lines():
    lines = {m: sum(1 for _ in open(path_of(m))) for m in project_modules()}
    assert {m: n for m, n in lines.items() if n > MAX_LINES} == {}


# The modules that build the run; every other one takes the values it uses (named arguments, or a small record such as
# forward.Forward or tools.ToolLimits), so a helper's inputs are visible and a notebook calls it without a Config.
CONFIG_USERS = {"config", "build", "train_ppo"}


def test_only_the_run_builders_import_config():
    users = {m for m in project_modules() for name, _ in imports(m) if name == "config.Config"}
    assert users <= CONFIG_USERS, f"{sorted(users - CONFIG_USERS)} import config.Config"


def test_losses_imports_torch_and_the_standard_library_only():
    for module in ("losses", "logprobs"):  # imported from notebooks with nothing but torch installed
        names = {name.split(".")[0] for name, _ in imports(module)}
        assert names - {"torch", "einops"} - set(sys.stdlib_module_names) == set(), module


def preset_args(path: str) -> list[str]:
    """The arguments a runs/ script passes on (after train_ppo.py or runs/cpu.sh), up to its "$@"."""
    with open(path) as f:
        words = shlex.split(f.read().replace("\\\n", " "), comments=True)
    start = next(i for i, w in enumerate(words) if w in ("train_ppo.py", "runs/cpu.sh")) + 1
    return words[start : words.index("$@")]


def test_cpu_preset_writes_out_every_config_field():
    import tyro

    from config import Config

    args = preset_args(os.path.join(REPO, "runs", "cpu.sh"))
    flags = [a[2:] for a in args if a.startswith("--")]
    names = [f.name.replace("_", "-") for f in dataclasses.fields(Config)]
    bools = {f.name.replace("_", "-") for f in dataclasses.fields(Config) if f.type in ("bool", bool)}
    given = [f[3:] if f.startswith("no-") and f[3:] in bools else f for f in flags]
    assert sorted(given) == sorted(names), (
        f"missing {sorted(set(names) - set(given))}, unknown {sorted(set(given) - set(names))}"
    )
    tyro.cli(Config, args=args)  # and every value parses


def test_other_presets_list_only_what_differs_from_cpu_sh():
    for path in sorted(set(glob.glob(os.path.join(REPO, "runs", "*.sh"))) - {os.path.join(REPO, "runs", "cpu.sh")}):
        with open(path) as f:
            text = f.read()
        assert "exec bash runs/cpu.sh" in text and "train_ppo.py" not in text, f"{path} must call runs/cpu.sh"
        assert preset_args(path), path
