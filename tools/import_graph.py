"""Prints the import graph of the ``zero_jax`` package and any cycle in it.

Modules are named by their path inside the package: ``train_step``, ``comm.collectives``,
``checkpoint.manager``. Every ``import zero_jax.x`` / ``from zero_jax[.x] import ...``
counts, wherever it stands (module level, inside a function, under ``TYPE_CHECKING``); a
package's ``__init__`` counts as the package. Usage::

  python tools/import_graph.py            # one line per module: what it imports
  python tools/import_graph.py --check    # exit 1 on a cycle, an upward import, a folder not in ORDER
  python tools/import_graph.py --folders  # the graph between the subpackages and the top
"""

import ast
import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "zero_jax"


def _name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _targets(node, here: str, modules: set[str]) -> set[str]:
  """The modules of the package an import statement names."""
  if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zero_jax"):
    base = node.module[len("zero_jax"):].lstrip(".")
    found = set()
    for a in node.names:  # `from zero_jax.comm import layout`: the module comm.layout
      sub = f"{base}.{a.name}" if base else a.name
      found.add(sub if sub in modules else base)
    return found
  if isinstance(node, ast.Import):
    return {a.name[len("zero_jax."):] for a in node.names if a.name.startswith("zero_jax.")}
  return set()


def graph() -> dict[str, set[str]]:
  files = {_name(p): p for p in PACKAGE.rglob("*.py")}
  modules = set(files) - {""}
  edges = {}
  for name in sorted(modules):
    deps = set()
    for node in ast.walk(ast.parse(files[name].read_text())):
      deps |= _targets(node, name, modules)
    edges[name] = {d for d in deps if d in modules} - {name}
  return edges


# The folders from the top of the package to its bottom: a module may import its own folder
# and any folder below it, never one above ("" is the package's __init__, which re-exports;
# "_compat" the one place that reaches into private APIs, imported from anywhere).
ORDER = ("", "checkpoint", "gpu", "step", "layers", "numerics", "processes", "comm",
         "_compat")


def folder(module: str) -> str:
  """The subpackage a module belongs to, or "" for the package's __init__."""
  return module.split(".")[0]


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
  """Every import of a module from a folder above its own (by `ORDER`), as (module, target)."""
  rank = {f: i for i, f in enumerate(ORDER)}
  return sorted((m, d) for m, deps in edges.items() for d in deps
                if rank.get(folder(d), -1) < rank.get(folder(m), -1))


def folder_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
  out: dict[str, set[str]] = {}
  for name, deps in edges.items():
    out.setdefault(folder(name), set()).update(folder(d) for d in deps)
  return {k: v - {k} for k, v in out.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """Every elementary cycle's nodes, found by depth-first search (small graphs only)."""
  found, seen = [], set()

  def walk(node, path):
    for nxt in sorted(edges.get(node, ())):
      if nxt in path:
        cyc = path[path.index(nxt):]
        key = frozenset(cyc)
        if key not in seen:
          seen.add(key)
          found.append(cyc + [nxt])
      elif len(path) < len(edges):
        walk(nxt, path + [nxt])
  for start in sorted(edges):
    walk(start, [start])
  return found


def main(argv) -> int:
  edges = graph()
  if "--folders" in argv:
    edges = {k or "(top)": {d or "(top)" for d in v} for k, v in folder_edges(edges).items()}
  for name, deps in edges.items():
    print(f"{name}: {', '.join(sorted(deps)) or '-'}")
  found = cycles(edges)
  for c in found:
    print("cycle:", " -> ".join(c))
  up = upward(graph())
  for m, d in up:
    print(f"upward: {m} -> {d}")
  unknown = sorted({folder(m) for m in graph()} - set(ORDER))
  for f in unknown:
    print(f"folder not in ORDER: {f}")
  print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports, {len(found)} cycles, "
        f"{len(up)} upward imports")
  return 1 if (found or up or unknown) and "--check" in argv else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
