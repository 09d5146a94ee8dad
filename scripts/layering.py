#!/usr/bin/env python3
"""The gateway's layering, checked (scripts/test.sh runs it): its module graph has no import
circles — policies and pure parsers at the bottom, the request driver and its transports above,
`server.rs` at the top — and no function in gateway/src is over 80 lines (tests aside).

A module is a top-level module of gateway/src (`proxy`, `epp`, `state`, …), and, to see circles
inside the larger ones, each file or folder under them (`proxy/driver`, `kv_events/prompt`);
a module points at another when its code (comments and `#[cfg(test)] mod tests` aside) names it
(`crate::x`, `crate::{x, …}`, or a sibling through `super::x`). A child naming its parent
(`super::ProxyApp`) is not an edge: the parent declares the child.

Exit status: 0 when both hold, 1 with each circle (and its edges) or long function listed.
Usage: python3 scripts/layering.py [SRC]   (default gateway/src)
"""
import os
import re
import sys

MAX_FUNCTION_LINES = 80


def code_of(path):
    """The file's code: without its test module, comments and string contents."""
    src = open(path, encoding="utf-8").read()
    cut = re.search(r"^#\[cfg\(test\)\]\s*\n\s*(pub(\(crate\))? )?mod tests", src, re.M)
    if cut:
        src = src[: cut.start()]
    src = re.sub(r'"(\\.|[^"\\])*"', '""', src)
    src = re.sub(r"'(\\.|[^'\\])'", "' '", src)
    return re.sub(r"//[^\n]*", "", src)


def module_of(root, path):
    """(top-level module, finer module) of a source file."""
    parts = os.path.relpath(path, root)[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    if not parts:
        return None, None
    top = parts[0]
    return top, "/".join(parts[:2])


def graph(root):
    """Edges at both granularities: {module: {module it names}}."""
    coarse, fine = {}, {}
    for d, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(d, f)
            top, mod = module_of(root, path)
            if top is None:
                continue
            code = code_of(path)
            coarse.setdefault(top, set())
            fine.setdefault(mod, set())
            named = set(re.findall(r"crate::(\w+)(?:::(\w+))?", code))
            for group in re.findall(r"crate::\{([^}]*)\}", code):
                named |= {(p.strip().split("::")[0], "") for p in group.split(",") if p.strip()}
            for a, b in named:
                if a != top:
                    coarse[top].add(a)
                child = f"{a}/{b}"
                target = child if b and os.path.exists(os.path.join(root, a, b + ".rs")) or (
                    b and os.path.isdir(os.path.join(root, a, b))) else a
                if target != mod:
                    fine[mod].add(target)
            if "/" in mod:
                for b in re.findall(r"super::(\w+)", code):
                    sibling = f"{top}/{b}"
                    if (os.path.exists(os.path.join(root, top, b + ".rs")) or os.path.isdir(
                            os.path.join(root, top, b))) and sibling != mod:
                        fine[mod].add(sibling)
    return coarse, fine


def circles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
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
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def long_functions(root):
    """(file, line, name, lines) of each function over the limit, tests aside."""
    found = []
    for d, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(d, f)
            lines = code_of(path).split("\n")
            i = 0
            while i < len(lines):
                m = re.match(r"\s*(pub(\([^)]*\))?\s+)?(async\s+)?(const\s+)?(unsafe\s+)?fn\s+(\w+)", lines[i])
                if not m:
                    i += 1
                    continue
                depth, started, j = 0, False, i
                while j < len(lines):
                    for ch in lines[j]:
                        if ch == "{":
                            depth += 1
                            started = True
                        elif ch == "}":
                            depth -= 1
                    if started and depth == 0:
                        break
                    if not started and lines[j].rstrip().endswith(";"):
                        break
                    j += 1
                if started and j - i + 1 > MAX_FUNCTION_LINES:
                    found.append((path, i + 1, m.group(6), j - i + 1))
                i += 1
    return found


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "gateway", "src")
    coarse, fine = graph(root)
    problems = 0
    for edges in (coarse, fine):
        for comp in circles(edges):
            problems += 1
            print(f"import circle: {' ⇄ '.join(comp)}")
            for m in comp:
                print(f"    {m} -> {', '.join(sorted(d for d in edges[m] if d in comp))}")
    # The fuzz entry point is test code behind a feature.
    for path, line, name, n in long_functions(root):
        if os.path.basename(path) == "fuzzing.rs":
            continue
        problems += 1
        print(f"{os.path.relpath(path)}:{line}: fn {name} is {n} lines (at most {MAX_FUNCTION_LINES})")
    if problems:
        print(f"layering: {problems} problem(s)")
        return 1
    print(f"layering: {len(coarse)} modules, {len(fine)} at the finer grain, no import circle, "
          f"no function over {MAX_FUNCTION_LINES} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
