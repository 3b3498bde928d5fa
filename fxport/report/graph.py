"""The report's FX graph drawings: Graphviz's `dot` lays out `graph_before` and `graph_after`, within a budget.

What the drawing costs is dot's layout, and that grows with the boxes and with how far the edges
reach: an edge across k ranks adds k - 1 hidden nodes that dot must order. A DenseNet's
concatenations join every earlier feature map, so 300 of its nodes held 17,000 of them and dot ran
past a minute, twice (before and after the passes), where a ResNet-50's 180 boxes take 0.6 s.
So a drawing has a budget: MAX_DRAWN_NODES boxes, and MAX_LAYOUT_COST boxes plus hidden nodes
(measured on a 2-core VM with DenseNet-121's first nodes: 100 boxes with 880 cost 0.09 s, 150 with
3,100 took 0.7 s, 200 with 4,000 took 2 s, 250 with 8,000 took 10 s, 300 with 17,400 over 40 s). A
graph past it is drawn as a summary, and the report says which: runs of nodes that each feed only
the next fold into one box; if that is not enough, edges that a longer path already implies are
left out; then only the first boxes. DenseNet-121 (433 nodes) becomes 65 boxes, drawn in 0.1 s.
`dot` itself runs under DOT_TIMEOUT_S: past it the report shows a note, never hangs.

Who runs `dot` is the caller's choice (`layout`): by default a plain subprocess; a worker passes
one confined like its sandbox (fxport/workers/sandbox/confine.py `confined_dot`), since the
sandboxed engine itself may not start processes. Layouts are remembered by the sha256 of the DOT
source: the same architecture (new weights, a rerun, graph_after == graph_before when no pass
changed anything) is laid out once per process; one that ran out of time, once per report.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from markupsafe import Markup

from fxport.manifest_sections import GraphNode, GraphSummary
from fxport.report.charts import strip_scripts_and_comments

# DOT source → SVG bytes; raises FileNotFoundError when there is no `dot` to run.
DotLayout = Callable[[bytes], bytes]

# Diagrams with more boxes than this start collapsed.
COLLAPSE_ABOVE_NODES = 60
# A drawing's budget: boxes, and boxes plus the hidden nodes of the edges that cross ranks.
MAX_DRAWN_NODES = 300
MAX_LAYOUT_COST = 3000
# Within the budget dot takes a second or two; the limit guards against a graph the estimate misjudges.
DOT_TIMEOUT_S = 10
LAYOUT_CACHE_ENTRIES = 64

SHAPE_CHECK_TARGETS = ("_assert", "sym_constrain_range", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset")
SIZE_ARITHMETIC = {"le", "ge", "lt", "gt", "eq", "ne", "and_", "or_", "not_", "add", "sub", "mul", "floordiv", "mod",
                   "truediv", "sym_not", "sym_max", "sym_min"}
OP_COLOURS = {"placeholder": "#c8e6c9", "output": "#ffe0b2", "call_module": "#bbdefb",
              "call_function": "#e3f2fd", "call_method": "#e1bee7"}

Missing = Literal["graphviz", "dot", "timeout", "failed"]


@dataclass
class Box:
    """What one box of the drawing stands for: one node, or a run of nodes that each feed only the next."""

    members: list[GraphNode]

    @property
    def head(self) -> GraphNode:
        return self.members[0]


@dataclass
class Plan:
    """The boxes and edges to draw (edges as pairs of box indices), and what the summary left out."""

    boxes: list[Box]
    edges: list[tuple[int, int]]
    notes: list[str] = field(default_factory=list)


@dataclass
class GraphView:
    """One graph as the report shows it: the drawing (or why there is none), its notes, the node table."""

    prefix: str
    title: str
    total: int  # nodes in the graph
    nodes: list[GraphNode]  # the nodes the manifest lists (the table's rows)
    boxes: int  # boxes drawn
    notes: list[str]
    svg: Markup | None = None
    missing: Missing | None = None
    why: str = ""  # what dot said, when it failed

    @property
    def open(self) -> bool:
        return self.boxes <= COLLAPSE_ABOVE_NODES

    @property
    def timeout_s(self) -> int:
        return DOT_TIMEOUT_S


def graph_view(prefix: str, title: str, graph: GraphSummary, layout: DotLayout,
               timed_out: set[str] | None = None) -> GraphView:
    """`graph` drawn (within the budget) and tabled, for the section's template. `timed_out`: the
    sha256 of each DOT source that ran out of time in this report (graph_after is often graph_before)."""
    nodes = graph.nodes
    total = graph.node_count or len(nodes)
    notes = []
    if len(nodes) < total:
        notes.append(f"the manifest lists only the first {len(nodes)} of {total} nodes")
    checks = shape_checks(nodes)
    if checks:
        notes.append(f"{len(checks)} shape-check nodes (sym_size, _assert_scalar, comparisons of sizes, ...) are "
                     "left out of the drawing; the table lists them")
    drawable = [n for n in nodes if n.op != "get_attr" and n.name not in checks]
    plan = plan_drawing(drawable)
    view = GraphView(prefix, title, total, nodes, len(plan.boxes), notes + plan.notes)
    params = {n.name for n in nodes if n.op == "get_attr"}
    _draw(view, plan, params, layout, set() if timed_out is None else timed_out)
    return view


# ---------------------------------------------------------------- which nodes are shape checks


def shape_checks(nodes: Iterable[GraphNode | Mapping[str, Any]]) -> set[str]:
    """The nodes of a graph that only check or compute sizes: the asserts and range constraints,
    the size reads (sym_size, x.size()), and Python operators (getitem, comparisons, arithmetic)
    whose every input is one of them. In a dynamic-shape program they were 16 of 27 boxes; the
    computation is the rest."""
    out: set[str] = set()
    for n in nodes:
        node = n if isinstance(n, GraphNode) else GraphNode.model_validate(n)
        target = node.target or ""
        if node.op == "call_method" and target in ("size", "dim", "numel", "stride"):  # a traced graph's x.size()
            out.add(node.name)
            continue
        if node.op != "call_function":
            continue
        if any(t in target for t in SHAPE_CHECK_TARGETS):
            out.add(node.name)
            continue
        module, _, fn = target.rpartition(".")
        if module in ("operator", "_operator", "torch") and (fn in SIZE_ARITHMETIC or fn == "getitem") \
                and node.inputs and all(i in out for i in node.inputs):
            out.add(node.name)
    return out


# ---------------------------------------------------------------- the budget


def layout_cost(count: int, edges: Sequence[tuple[int, int]]) -> int:
    """Boxes plus the hidden nodes dot adds for edges that cross ranks (ranks by longest path; boxes
    come in topological order, as an FX graph lists its nodes)."""
    preds: list[list[int]] = [[] for _ in range(count)]
    for src, dst in edges:
        if src < dst < count:
            preds[dst].append(src)
    rank = [0] * count
    for v in range(count):
        rank[v] = max((rank[u] + 1 for u in preds[v]), default=0)
    return count + sum(rank[dst] - rank[src] - 1 for src, dst in edges if src < dst < count)


def _within(count: int, edges: Sequence[tuple[int, int]]) -> bool:
    return count <= MAX_DRAWN_NODES and layout_cost(count, edges) <= MAX_LAYOUT_COST


def plan_drawing(drawable: list[GraphNode]) -> Plan:
    """Every node as a box, or, past the budget, the summary (see the module's docstring)."""
    plan = Plan([Box([n]) for n in drawable], _edges([[n] for n in drawable]))
    if _within(len(plan.boxes), plan.edges):
        return plan
    runs = _runs(drawable)
    folded = Plan([Box(run) for run in runs], _edges(runs))
    folded.notes.append(
        f"{len(drawable)} nodes to draw are more than dot lays out in a few seconds: this is a summary, in which "
        f"each run of nodes that feed only the next is one box ({len(drawable)} nodes in {len(runs)} boxes); "
        "the table lists every node")
    if _within(len(folded.boxes), folded.edges):
        return folded
    kept = transitive_reduction(len(folded.boxes), folded.edges)
    if len(kept) < len(folded.edges):
        folded.notes.append(f"{len(folded.edges) - len(kept)} of {len(folded.edges)} edges are left out: each joins "
                            "two boxes that a longer path already joins")
        folded.edges = kept
    if _within(len(folded.boxes), folded.edges):
        return folded
    first = _longest_prefix_within(len(folded.boxes), folded.edges)
    folded.notes.append(f"drawing only the first {first} of {len(folded.boxes)} boxes; the table has every node")
    folded.boxes = folded.boxes[:first]
    folded.edges = [(s, d) for s, d in folded.edges if d < first]
    return folded


def _edges(groups: list[list[GraphNode]]) -> list[tuple[int, int]]:
    """The edges between groups of nodes (a node's inputs from another group), each once."""
    where = {n.name: i for i, group in enumerate(groups) for n in group}
    edges: dict[tuple[int, int], None] = {}
    for dst, group in enumerate(groups):
        for n in group:
            for name in n.inputs:
                src = where.get(name)
                if src is not None and src != dst:
                    edges[(src, dst)] = None
    return list(edges)


def _runs(drawable: list[GraphNode]) -> list[list[GraphNode]]:
    """The nodes in runs: a node joins the run of its input when that is its only input and the
    input feeds nothing else (graph inputs and outputs stay boxes of their own)."""
    names = {n.name for n in drawable}
    consumers: dict[str, int] = {}
    for n in drawable:
        for name in set(n.inputs) & names:
            consumers[name] = consumers.get(name, 0) + 1
    run_of: dict[str, list[GraphNode]] = {}
    runs: list[list[GraphNode]] = []
    for n in drawable:
        inputs = list(dict.fromkeys(i for i in n.inputs if i in names))
        joins = (len(inputs) == 1 and consumers.get(inputs[0]) == 1 and inputs[0] in run_of
                 and n.op not in ("placeholder", "output") and run_of[inputs[0]][0].op != "placeholder")
        run = run_of[inputs[0]] if joins else []
        if not joins:
            runs.append(run)
        run.append(n)
        run_of[n.name] = run
    return runs


def transitive_reduction(count: int, edges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """`edges` without those from u to v where another path leads from u to v (boxes in topological order)."""
    preds: list[list[int]] = [[] for _ in range(count)]
    for src, dst in edges:
        preds[dst].append(src)
    ancestors = [0] * count  # bit u set: u reaches v
    for v in range(count):
        for u in preds[v]:
            ancestors[v] |= ancestors[u] | (1 << u)
    return [(u, v) for u, v in edges if not any((ancestors[w] >> u) & 1 for w in preds[v] if w != u)]


def _longest_prefix_within(count: int, edges: Sequence[tuple[int, int]]) -> int:
    lo, hi = 1, min(count, MAX_DRAWN_NODES)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if layout_cost(mid, [(s, d) for s, d in edges if d < mid]) <= MAX_LAYOUT_COST:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---------------------------------------------------------------- DOT and the layout


def _draw(view: GraphView, plan: Plan, params: set[str], layout: DotLayout, timed_out: set[str]) -> None:
    try:
        source = dot_source(plan, params)
    except ImportError:
        view.missing = "graphviz"
        return
    key = hashlib.sha256(source).hexdigest()
    try:
        if key in timed_out:
            raise subprocess.TimeoutExpired(["dot"], DOT_TIMEOUT_S)
        svg = _cached_layout(key, source, layout).decode("utf-8")
    except FileNotFoundError:
        view.missing = "dot"
        return
    except subprocess.TimeoutExpired:
        view.missing = "timeout"
        timed_out.add(key)
        return
    except subprocess.CalledProcessError as exc:  # a dot crash on an odd graph must not cost the rest of the report
        view.missing = "failed"
        view.why = (exc.stderr or b"").decode("utf-8", "replace").strip()[-300:] or f"exit status {exc.returncode}"
        return
    except Exception as exc:
        view.missing, view.why = "failed", f"{type(exc).__name__}: {exc}"
        return
    svg = svg[svg.find("<svg"):]  # drop the XML prolog and DOCTYPE: invalid inside HTML
    svg = strip_scripts_and_comments(svg)
    # Two graphs share one page: make dot's ids (graph0, node1, ...) unique per graph.
    svg = re.sub(r'\bid="([^"]*)"', lambda mt: f'id="{view.prefix}-{mt.group(1)}"', svg)
    view.svg = Markup(svg)  # dot's SVG writer escapes every label and tooltip


def dot_source(plan: Plan, params: set[str]) -> bytes:
    """The DOT text of `plan`. Node ids are opaque (n0, n1, ...): names from the manifest only ever
    appear in labels and tooltips, which dot XML-escapes, never in the SVG comments or ids it writes.
    Raises ImportError without the graphviz package."""
    import graphviz

    dot = graphviz.Digraph("fx", graph_attr={"rankdir": "TB", "nodesep": "0.25", "ranksep": "0.3"},
                           node_attr={"shape": "box", "style": "rounded,filled", "fontname": "Helvetica",
                                      "fontsize": "10", "height": "0.3", "margin": "0.08,0.03"},
                           edge_attr={"arrowsize": "0.6", "color": "#5f6368"})
    for i, box in enumerate(plan.boxes):
        lines, tooltip = _box_text(box, params)
        op = box.head.op or ""
        attrs = {"peripheries": "2"} if len(box.members) > 1 else {}
        dot.node(f"n{i}", label=graphviz.nohtml("\\n".join(_dot_text(s) for s in lines)),
                 tooltip=graphviz.nohtml(_dot_text(tooltip)), fillcolor=OP_COLOURS.get(op, "#eeeeee"),
                 shape="ellipse" if op in ("placeholder", "output") else "box", **attrs)
    for src, dst in plan.edges:
        dot.edge(f"n{src}", f"n{dst}")
    return dot.source.encode("utf-8")


def _box_text(box: Box, params: set[str]) -> tuple[list[str], str]:
    """A box's label lines and tooltip: name and short target, the parameters folded into it; a run's
    first and last names and its ops."""
    folded = [i for n in box.members for i in n.inputs if i in params]
    if len(box.members) == 1:
        n = box.head
        short = short_target(n.target)
        lines = [n.name] if n.op in ("placeholder", "output") or short == n.name else [n.name, short]
        tooltip = f"{n.name}: {n.op} {n.target}"
    else:
        # a module's own name (norm1), not its path (features.denseblock1.denselayer1.norm1)
        ops = [short_target(n.target).rsplit(".", 1)[-1] if n.op == "call_module" else short_target(n.target)
               for n in box.members]
        lines = [f"{box.head.name} … {box.members[-1].name}",
                 " → ".join(ops) if len(ops) <= 4 else f"{len(ops)} nodes: {' → '.join(ops[:3])} → …"]
        tooltip = "; ".join(f"{n.name}: {n.op} {n.target}" for n in box.members[:20]) \
            + (f"; … {len(box.members) - 20} more" if len(box.members) > 20 else "")
    if folded:
        lines.append(f"+{len(folded)} param{'s' if len(folded) > 1 else ''}")
        tooltip += f" | params: {', '.join(folded)}"
    return lines, tooltip


def _dot_text(s: str) -> str:
    # In a DOT label a backslash starts an escape (\n, \l, \N); a node name must print as written.
    return str(s).replace("\\", "\\\\")


def short_target(target: Any) -> str:
    """'aten.conv2d.default' → 'conv2d'; '_operator.getitem' → 'getitem'; module paths stay."""
    t = str(target or "")
    if t.startswith("aten."):
        return t.split(".")[1]
    if t.startswith(("_operator.", "torch.", "builtins.")):
        return t.rsplit(".", 1)[-1]
    return t


def find_dot(path: str | None = None) -> str:
    """Graphviz's `dot` on `path` (default: PATH), or FileNotFoundError. Looked up before a
    layout is started: without Graphviz a report then costs a few stat calls instead of a fork
    of this process per graph (a worker forks its whole address space for a confined `dot`)."""
    found = shutil.which("dot", path=path)
    if found is None:
        raise FileNotFoundError("Graphviz dot is not on PATH")
    return found


def run_dot(source: bytes) -> bytes:
    """`dot -Tsvg` as a plain subprocess (a local `fxport convert` or `fxport report`), killed past DOT_TIMEOUT_S."""
    return subprocess.run([find_dot(), "-Tsvg"], input=source, capture_output=True, check=True,
                          timeout=DOT_TIMEOUT_S).stdout


# keyed on the DOT source's sha256 (all a layout depends on, with `dot` fixed for a process's life). A layout
# that ran out of time is not kept: the next report tries again (a busy machine is no property of the graph).
_layouts: OrderedDict[str, bytes] = OrderedDict()
_layouts_lock = threading.Lock()


def _cached_layout(key: str, source: bytes, layout: DotLayout) -> bytes:
    """`layout(source)`, remembered by `key`, the source's sha256 (the LAYOUT_CACHE_ENTRIES most recent)."""
    with _layouts_lock:
        if key in _layouts:
            _layouts.move_to_end(key)
            return _layouts[key]
    svg = layout(source)
    with _layouts_lock:
        _layouts[key] = svg
        while len(_layouts) > LAYOUT_CACHE_ENTRIES:
            _layouts.popitem(last=False)
    return svg


def clear_layout_cache() -> None:
    """Forget every layout (tests that change what `dot` is)."""
    with _layouts_lock:
        _layouts.clear()
