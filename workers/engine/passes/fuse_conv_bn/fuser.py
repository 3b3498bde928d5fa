"""What every fold of fuse_conv_bn shares: the walk from a batch norm back through shape ops to its
layer, the checks that no other node reads what the fold changes, the bookkeeping of what was
folded and what was left (and why), and the notes made of it."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from torch.fx import GraphModule, Node
from torch.fx.passes.shape_prop import ShapeProp

from fxport.pass_catalog import FuseConvBnOptions
from fxport.workers.engine.passes import PassContext
from fxport.workers.engine.passes.fuse_conv_bn.ops import _named, _op_label, _Site
from fxport.workers.engine.passes.fuse_conv_bn.shapes import _reads_only_shape
from fxport.workers.engine.passes.graph_attrs import AttrUses, node_rank


class _FuserBase:
    """One pass over one graph: its options, what was folded and left, and what may now be dead."""

    def __init__(self, gm: GraphModule, opts: FuseConvBnOptions, ctx: PassContext, *, look_through: bool) -> None:
        self.gm, self.opts, self.ctx = gm, opts, ctx
        self.look_through = look_through
        # "BatchNorm1d into Linear through flatten" → one entry per fold: "bn into fc" when shape
        # ops sat between them (the notes name those), "" for a plain fold (the notes count it)
        self.folded: dict[str, list[str]] = defaultdict(list)
        self.left: dict[str, list[str]] = defaultdict(list)  # "BatchNorm2d: reason" → batch norm names
        self.maybe_dead: list[Node] = []
        self.bn_prefixes: set[str] = set()
        self._shapes_known = False
        self._attr_uses: AttrUses | None = None
        self._calls: Counter[str] | None = None  # call_module target → calls
        self._attr_owners: set[str] | None = None  # every module a get_attr node reads inside of

    def attr_uses(self) -> AttrUses:
        """Graph uses per tensor, from one scan at the first question, kept current by the folds after it."""
        if self._attr_uses is None:
            self._attr_uses = AttrUses(self.gm)
        return self._attr_uses

    def submodule_replaced(self) -> None:
        """A fold rebound a submodule: what get_attr nodes under it fetch may have changed."""
        self._attr_uses = None

    def module_calls(self, target: str) -> int:
        """How many call_module nodes call `target`, from one scan per pass."""
        if self._calls is None:
            self._calls = Counter(str(n.target) for n in self.gm.graph.nodes if n.op == "call_module")
        return self._calls[target]

    def module_call_erased(self, node: Node) -> None:
        if self._calls is not None:
            self._calls[str(node.target)] -= 1

    def attrs_read_inside(self, prefix: str) -> bool:
        """Whether a get_attr node reads something inside the module at `prefix`, from one scan per pass."""
        if self._attr_owners is None:
            self._attr_owners = set()
            for node in self.gm.graph.find_nodes(op="get_attr"):
                self.attr_added(node)
        return prefix in self._attr_owners

    def attr_added(self, node: Node) -> None:
        """Count a new get_attr node in the indexes built so far."""
        if self._attr_uses is not None:
            self._attr_uses.added(node)
        if self._attr_owners is not None:
            parts = str(node.target).split(".")
            self._attr_owners.update(".".join(parts[:i]) for i in range(1, len(parts)))

    def _look_through(self, src, is_shape_op) -> tuple[Any, list[Node]]:
        """The node behind `src` and the shape ops passed on the way, in graph order."""
        ops: list[Node] = []
        while self.look_through and isinstance(src, Node) and is_shape_op(src):
            ops.append(src)
            src = src.args[0]
        return src, ops[::-1]

    def _other_readers(self, layer: Node, ops: list[Node], kind: str) -> str | None:
        """Why the fold would change what another node reads: the layer's output, or a shape
        op's between it and the batch norm, has a user besides the next one that reads values."""
        labels = [kind, *(_op_label(self.gm, op) for op in ops)]
        for node, label in zip([layer, *ops], labels):
            readers = [u for u in node.users if not _reads_only_shape(u, node)]
            if len(readers) != 1:
                return f"the {label} output has {len(readers)} users"
        return None

    def _through(self, ops: list[Node]) -> str:
        """` through flatten`: the shape ops between a layer and its batch norm, for notes."""
        if not ops:
            return ""
        return " through " + "+".join(dict.fromkeys(_op_label(self.gm, op) for op in ops))

    def _moved(self, kind: str, ops: list[Node], axes: set[int]) -> str:
        where = ", ".join(str(a) for a in sorted(axes)) or "no dim"
        return (f"{self._through(ops).strip()} the {kind}'s output channels land on dim {where}, "
                "but BatchNorm normalizes dim 1")

    def _record(self, site: _Site, kind: str, layer_name: str, ops: list[Node]) -> None:
        self.folded[f"{site.kind} into {kind}{self._through(ops)}"].append(
            f"{site.name} into {layer_name}" if ops else "")

    def _rank(self, node: Node) -> int | None:
        rank = node_rank(node)
        if rank is None and not self._shapes_known and self.ctx.example_inputs:
            self._shapes_known = True
            try:
                ShapeProp(self.gm).propagate(*self.ctx.example_inputs)
            except Exception:  # shapes are a safety check; without them we stay conservative
                pass
            rank = node_rank(node)
        return rank

    def _leave(self, site: _Site, reason: str) -> None:
        self.left[f"{site.kind}: {reason}"].append(site.name)
        return None

    def notes(self) -> str:
        """Counts, and names where they help: `folded 5 BatchNorm2d into Conv2d; 2 BatchNorm1d into
        Linear through flatten (bn1 into fc1, bn2 into fc2). Left 1 BatchNorm2d: the Conv2d output
        has 2 users (bn)`. A plain fold is only counted: it is what the pass is expected to do."""
        def entries(groups: dict[str, list[str]]) -> str:
            return "; ".join(f"{len(names)} {what}{_named(names)}" for what, names in groups.items())

        parts = []
        if self.folded:
            parts.append("folded " + entries(self.folded))
        if self.left:
            parts.append(("Left " if parts else "left ") + entries(self.left))
        return ". ".join(parts) if parts else "no BatchNorm nodes"
