"""Prints the import graph of the ``zero_jax`` package and any cycle in it.

Every ``import zero_jax.x`` / ``from zero_jax[.x] import ...`` counts, wherever it stands
(module level, inside a function, under ``TYPE_CHECKING``). Usage::

  python tools/import_graph.py          # one line per module: what it imports
  python tools/import_graph.py --check  # exit 1 if there is a cycle
"""

import ast
import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "zero_jax"


def graph() -> dict[str, set[str]]:
  modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
  edges = {}
  for name in sorted(modules):
    deps = set()
    for node in ast.walk(ast.parse((PACKAGE / f"{name}.py").read_text())):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zero_jax"):
        parts = node.module.split(".")
        deps |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
      elif isinstance(node, ast.Import):
        deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("zero_jax.")}
    edges[name] = (deps & modules) - {name}
  return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """Every elementary cycle's nodes, found by depth-first search (small graphs only)."""
  found, seen = [], set()

  def walk(node, path):
    for nxt in sorted(edges[node]):
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
  for name, deps in edges.items():
    print(f"{name}: {', '.join(sorted(deps)) or '-'}")
  found = cycles(edges)
  for c in found:
    print("cycle:", " -> ".join(c))
  print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports, {len(found)} cycles")
  return 1 if found and "--check" in argv else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
