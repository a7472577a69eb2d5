#!/usr/bin/env python3
"""Checks that no package's rooms include each other in a loop (docs/architecture.md).

A room is a source file's stem (engine/config.h and engine/config.cc are the room
engine/config); a package's subfolder (engine/save/, engine/internal/) is one room per
stem too. Room A depends on room B when a file of A includes a header of B. A loop
(A on B and B on A, directly or through others) means neither room can be read, built
or changed without the other: split the shared part into a room both include.

An include listed in tools/room_exceptions.txt ("A -> B  reason") is not counted: the
pattern docs/architecture.md allows, an internal header that defines a public class's
private member (Engine::Impl), whose public room includes it back.

  tools/check_rooms.py               check the tree (tests apart)
  tools/check_rooms.py --self-test   check that a made-up loop is caught
"""
import os
import re
import sys
import tempfile

PACKAGES = ["runtime", "nn", "rng", "data", "optim", "checkpointing", "parallel", "models", "engine"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def rooms_of(root, package):
    """{room: set of rooms it includes} for one package's library files."""
    graph = {}
    for folder, _, files in os.walk(os.path.join(root, package)):
        for name in files:
            if not name.endswith((".cc", ".h")) or name.endswith(("_test.cc", "_test.h")):
                continue
            path = os.path.relpath(os.path.join(folder, name), root)
            room = os.path.splitext(path)[0]
            deps = graph.setdefault(room, set())
            with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
                for header in INCLUDE.findall(f.read()):
                    other = os.path.splitext(header)[0]
                    if header.startswith(package + "/") and other != room:
                        deps.add(other)
    return graph


def loops(graph):
    """The strongly connected components of more than one room (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def exceptions(root):
    """{(A, B)}: the includes tools/room_exceptions.txt allows."""
    path = os.path.join(root, "tools", "room_exceptions.txt")
    allowed = set()
    if os.path.exists(path):
        for line in open(path, encoding="utf-8"):
            parts = line.split()
            if len(parts) >= 3 and not line.startswith("#") and parts[1] == "->":
                allowed.add((parts[0], parts[2]))
    return allowed


def check(root):
    bad = []
    allowed = exceptions(root)
    for package in PACKAGES:
        if not os.path.isdir(os.path.join(root, package)):
            continue
        graph = rooms_of(root, package)
        for room, deps in graph.items():
            deps -= {b for (a, b) in allowed if a == room}
        for component in loops(graph):
            edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in component]
            bad.append(f"{package}/: rooms in a loop: {', '.join(component)} ({'; '.join(edges)}): "
                       "move what they share into a room both include, so that one of them does not "
                       "include the other")
    return bad


def self_test():
    with tempfile.TemporaryDirectory() as root:
        files = {
            "engine/a.h": "",
            "engine/a.cc": '#include "engine/a.h"\n#include "engine/b.h"\n',
            "engine/b.h": "",
            "engine/b.cc": '#include "engine/b.h"\n#include "engine/a.h"\n',
            "engine/c.cc": '#include "engine/a.h"\n',
            "parallel/x.h": '#include "parallel/y.h"\n',
            "parallel/y.h": "",
        }
        for path, text in files.items():
            os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
            with open(os.path.join(root, path), "w") as f:
                f.write(text)
        bad = check(root)
        if len(bad) == 1 and "engine/a, engine/b" in bad[0]:
            print("check_rooms self-test: the loop engine/a <-> engine/b caught, engine/c and parallel/ passed")
            return 0
        print("check_rooms self-test failed:", *bad, sep="\n")
        return 1


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    bad = check(root)
    for line in bad:
        print(line)
    if not bad:
        print("rooms: no package's rooms include each other in a loop")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
