"""Size and shape figures of the code, for a refactor's before/after table.

    python bench/code_stats.py            # this checkout
    python bench/code_stats.py --top 10   # the 10 longest functions

Prints the lines of each core module (.py at the root and in data/, as they stand: run `ruff format` first to count
formatted lines), the longest functions, the number of Config fields and the files that import Config.
"""

import argparse
import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def core_files() -> list[str]:
    root = [f for f in os.listdir(REPO) if f.endswith(".py")]
    data = [os.path.join("data", f) for f in os.listdir(os.path.join(REPO, "data")) if f.endswith(".py")]
    return sorted(root + data)


def functions(tree: ast.AST, path: str):
    """(lines, qualified name) for every function and method."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield child.end_lineno - child.lineno + 1, f"{path}:{node.name}.{child.name}"
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.end_lineno - node.lineno + 1, f"{path}:{node.name}"


def imports_config(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "config" and any(a.name == "Config" for a in node.names):
            return True
    return False


def takes_cfg(tree: ast.AST) -> list[str]:
    """The functions with a parameter named cfg (the whole Config handed in)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(a.arg == "cfg" for a in node.args.args + node.args.kwonlyargs):
                found.append(node.name)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--top", type=int, default=5, help="how many of the longest functions to print")
    args = p.parse_args()
    total, funcs, config_users, cfg_funcs = 0, [], [], {}
    print("lines  module")
    for path in core_files():
        with open(os.path.join(REPO, path)) as f:
            text = f.read()
        n, tree = text.count("\n"), ast.parse(text)
        total += n
        funcs += list(functions(tree, path))
        if names := takes_cfg(tree):
            cfg_funcs[path] = names
        if imports_config(tree):
            config_users.append(path)
        print(f"{n:5d}  {path}")
    print(f"{total:5d}  total")
    print("\nlongest functions:")
    for n, name in sorted(funcs, reverse=True)[: args.top]:
        print(f"{n:5d}  {name}")
    with open(os.path.join(REPO, "config.py")) as f:
        config = next(n for n in ast.parse(f.read()).body if isinstance(n, ast.ClassDef) and n.name == "Config")
    print(f"\nConfig fields: {sum(isinstance(n, ast.AnnAssign) for n in config.body)}")
    n = sum(map(len, cfg_funcs.values()))
    print(f"functions taking cfg: {n} in {len(cfg_funcs)} modules")
    for path, names in sorted(cfg_funcs.items()):
        print(f"  {path}: {', '.join(names)}")
    print(f"files importing Config ({len(config_users)}): {', '.join(config_users)}")


if __name__ == "__main__":
    main()
