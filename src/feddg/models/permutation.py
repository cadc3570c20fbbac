"""Permutation specs: which tensor axes a permutation of a layer's output channels must touch.

Permuting the output channels (filters) of a convolution leaves the network's function unchanged
only if the *same* permutation is applied to everything indexed by those channels: the conv's own
bias, the BatchNorm that follows (weight, bias, running statistics), the input channels of the
layer that consumes the map, the flattened input of the first linear layer (one block of ``H·W``
features per channel) and that layer's Gram matrix. In residual networks every block adds into the
same stream, so a whole stream shares one permutation. A :class:`PermutationSpec` writes this down
once per model; HFedATM's filter-wise OT alignment (``feddg.aggregation.fot``) finds the
permutations and :func:`apply_permutations` applies them.

A permutation ``p`` of a group of size ``c`` means: new channel ``i`` is old channel ``p[i]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor, nn

from feddg.models.alexnet import AlexNet
from feddg.models.cnn import SmallCNN
from feddg.models.efficientnet import EfficientNetLite
from feddg.models.hfedf_cnn import HFedFCNN, NaiveInception
from feddg.models.lenet import LeNet
from feddg.models.mlp import BagOfWordsMLP
from feddg.models.resnet import BasicBlock, Bottleneck, ResNet
from feddg.models.transformer import TextTransformer
from feddg.models.unet import UNet
from feddg.models.vgg import VGG

Permutations = dict[str, np.ndarray]


@dataclass(frozen=True)
class Axis:
    """Entries ``(offset + c) * block + j`` (``j < block``) of axis ``dim`` of ``key`` belong to channel ``c``.

    ``offset`` places a group inside a concatenation; ``block`` is the number of flattened features
    per channel (``H·W`` for a feature map flattened into a linear layer).
    """

    key: str
    dim: int
    offset: int = 0
    block: int = 1

    def positions(self, size: int) -> np.ndarray:
        """``[size, block]`` indices of the group's channels along ``dim``."""
        base = (self.offset + np.arange(size))[:, None] * self.block
        return base + np.arange(self.block)[None, :]


@dataclass(frozen=True)
class PermGroup:
    """One channel space that is permuted as a unit.

    ``producers``: the conv weight keys whose output channels (dim 0) *are* this group; FOT
    matches their filters. ``members``: every axis indexed by the group (producers included).
    """

    name: str
    size: int
    producers: tuple[str, ...]
    members: tuple[Axis, ...]


@dataclass(frozen=True)
class PermutationSpec:
    groups: tuple[PermGroup, ...]

    def prefixed(self, prefix: str) -> PermutationSpec:
        """The spec of a model nested at ``prefix`` (e.g. ``"net."`` inside a wrapper)."""
        if not prefix:
            return self
        return PermutationSpec(
            tuple(
                replace(
                    g,
                    name=prefix + g.name,
                    producers=tuple(prefix + p for p in g.producers),
                    members=tuple(replace(a, key=prefix + a.key) for a in g.members),
                )
                for g in self.groups
            )
        )

    @property
    def acyclic(self) -> bool:
        """True if every producer's input channels belong to groups listed before its own group.

        Then one forward pass of alignment is exact; residual streams make a spec cyclic.
        """
        seen: set[str] = set()
        for g in self.groups:
            for p in g.producers:
                inputs = {h.name for h in self.groups for a in h.members if a.key == p and a.dim == 1}
                if not inputs <= seen:
                    return False
            seen.add(g.name)
        return True


# ------------------------------------------------------------------------ applying permutations


@dataclass(frozen=True)
class RowGather:
    """A tensor's permutation as gathers along its leading dims: the permuted tensor, viewed as :meth:`view_shape`
    (``[len(rows), -1]``, or ``[len(rows), len(cols), -1]`` where dim 1 moves), is the original's with ``rows``
    taken along dim 0, then ``cols`` along dim 1. Taken in that order a chunk of filters is first copied as
    contiguous blocks, then reordered inside the cache: the means of M1's ResNet-18 merge took 0.11 s against 0.19 s
    on one thread (0.085 against 0.106 s on two) with one gather of ``k × k``-float rows from all over the tensor
    (docs/benchmarks.md, M1)."""

    rows: np.ndarray
    cols: np.ndarray | None = None

    def __post_init__(self) -> None:  # the gathers clip their indices (to write in place): refuse any but a permutation
        for name, index in (("rows", self.rows), ("cols", self.cols)):
            if index is not None and not _is_permutation(index):
                raise ValueError(f"RowGather {name} must be a permutation of 0..{len(index) - 1}")

    def view_shape(self, size: int) -> tuple[int, ...]:
        lead = (len(self.rows),) if self.cols is None else (len(self.rows), len(self.cols))
        return (*lead, size // int(np.prod(lead)) if size else 1)

    def flat(self) -> np.ndarray:
        """The same gather as one index along dim 0 of the tensor viewed as ``[len(rows) · len(cols), -1]``."""
        return self.rows if self.cols is None else (self.rows[:, None] * len(self.cols) + self.cols[None, :]).ravel()

    def take(self, view: np.ndarray, start: int, stop: int, out: np.ndarray, scratch: np.ndarray) -> np.ndarray:
        """Rows ``start:stop`` of the permuted ``view`` (the original as :meth:`view_shape`), written into ``out``;
        ``scratch`` (``out``'s shape) holds the dim-0 gather while ``cols`` reorders it."""
        m = stop - start  # mode="clip": np.take writes straight into ``out`` (mode="raise" buffers a copy)
        if self.cols is None:
            return np.take(view, self.rows[start:stop], axis=0, out=out[:m], mode="clip")
        np.take(view, self.rows[start:stop], axis=0, out=scratch[:m], mode="clip")
        return np.take(scratch[:m], self.cols, axis=1, out=out[:m], mode="clip")

    def apply(self, a: np.ndarray) -> np.ndarray:
        """A permuted copy of ``a``, in its shape."""
        moved = np.take(a.reshape(self.view_shape(a.size)), self.rows, axis=0)
        return (moved if self.cols is None else np.take(moved, self.cols, axis=1)).reshape(a.shape)


def _is_permutation(index: np.ndarray) -> bool:
    n = len(index)
    return index.ndim == 1 and (n == 0 or bool(index.min() >= 0 and index.max() < n and np.bincount(index, minlength=n).all()))


def permute_axis(t: Tensor, axis: Axis, perm: np.ndarray) -> Tensor:
    """``t`` with the channels of ``axis`` reordered by ``perm`` (other entries untouched)."""
    pos = axis.positions(len(perm))
    index = np.arange(t.shape[axis.dim])
    index[pos.ravel()] = pos[perm].ravel()
    return t.index_select(axis.dim, torch.from_numpy(index).to(t.device))


def apply_permutations(state: Mapping[str, Tensor], spec: PermutationSpec, perms: Permutations) -> dict[str, Tensor]:
    """A copy of ``state`` (a state_dict) with each group's permutation applied to all its members: each
    tensor is read once (one gather of the rows given by :func:`row_indices`, however many of its axes and
    groups move), as applying the members one ``index_select`` at a time would give."""
    out = dict(state)
    for key, gather in row_indices({k: tuple(v.shape) for k, v in state.items()}, spec, perms).items():
        t, rows = state[key], gather.flat()
        out[key] = t.reshape(len(rows), -1).index_select(0, torch.from_numpy(rows).to(t.device)).reshape(t.shape)
    return out


def row_indices(
    shapes: Mapping[str, tuple[int, ...]], spec: PermutationSpec, perms: Permutations
) -> dict[str, RowGather]:
    """For each tensor that ``perms`` move (``key -> shape``): its permutation as a :class:`RowGather` (dim 0's
    index, and dim 1's where that moves too)."""
    index: dict[str, dict[int, np.ndarray]] = {}
    for g in spec.groups:
        if g.name in perms:
            for a in g.members:
                dims = index.setdefault(a.key, {})
                current = dims.get(a.dim, np.arange(shapes[a.key][a.dim]))
                pos, perm = a.positions(len(perms[g.name])), perms[g.name]
                moved = np.arange(len(current))
                moved[pos.ravel()] = pos[perm].ravel()
                dims[a.dim] = current[moved]  # index_select by ``current``, then by ``moved``
    out = {}
    for key, dims in index.items():
        if set(dims) - {0, 1}:
            raise ValueError(f"{key}: only dims 0 and 1 can be permuted, got {sorted(dims)}")
        out[key] = RowGather(dims.get(0, np.arange(shapes[key][0])), dims.get(1))
    return out


def permute_grams(grams: Mapping[str, Tensor], spec: PermutationSpec, perms: Permutations) -> dict[str, Tensor]:
    """Permute the Gram matrices of linear layers (keyed by module name) whose *inputs* are permuted.

    The Gram ``X^T X`` of a layer's input is indexed by input features on both axes, exactly like
    the input axis (dim 1) of the layer's weight.
    """
    out = dict(grams)
    for g in spec.groups:
        if g.name not in perms:
            continue
        for a in g.members:
            layer = a.key.removesuffix(".weight")
            if a.dim == 1 and a.key.endswith(".weight") and layer in out:
                gram = permute_axis(out[layer], replace(a, dim=0), perms[g.name])
                out[layer] = permute_axis(gram, replace(a, dim=1), perms[g.name])
    return out


def random_permutations(spec: PermutationSpec, rng: np.random.Generator) -> Permutations:
    return {g.name: rng.permutation(g.size) for g in spec.groups}


# ------------------------------------------------------------------------------- spec builders


class _Builder:
    """Collects groups while walking a network in forward order."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = dict(model.named_modules())
        self.groups: dict[str, dict] = {}

    def new_group(self, conv: str) -> str:
        m = self.modules[conv]
        members = [Axis(f"{conv}.weight", 0)] + ([Axis(f"{conv}.bias", 0)] if m.bias is not None else [])
        size = m.out_features if isinstance(m, nn.Linear) else m.out_channels
        self.groups[conv] = {"size": size, "producers": [f"{conv}.weight"], "members": members}
        return conv

    def add_producer(self, group: str, conv: str, bn: str | None) -> None:
        m = self.modules[conv]
        self.groups[group]["producers"].append(f"{conv}.weight")
        bias = [Axis(f"{conv}.bias", 0)] if m.bias is not None else []
        self.groups[group]["members"] += [Axis(f"{conv}.weight", 0), *bias]
        if bn is not None:
            self.add_norm(group, bn)

    def add_norm(self, group: str, bn: str, offset: int = 0) -> None:
        keys = ("weight", "bias", "running_mean", "running_var")
        self.groups[group]["members"] += [Axis(f"{bn}.{k}", 0, offset) for k in keys]

    def consume(self, segments: list[tuple[str, int]], key: str, block: int = 1) -> None:
        for group, offset in segments:
            self.groups[group]["members"].append(Axis(key, 1, offset, block))

    def spec(self) -> PermutationSpec:
        return PermutationSpec(
            tuple(
                PermGroup(name, g["size"], tuple(g["producers"]), tuple(g["members"]))
                for name, g in self.groups.items()
            )
        )


_CHANNELWISE = (nn.ReLU, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Dropout, nn.Flatten, nn.Identity)


def _forward_leaves(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Leaf modules in registration order, with a naïve Inception module kept whole."""
    skip: tuple[str, ...] = ()
    for name, m in model.named_modules():
        if not name or (skip and name.startswith(skip)):
            continue
        if isinstance(m, NaiveInception):
            skip = (f"{name}.",)
            yield name, m
        elif not list(m.children()):
            yield name, m


def sequential_spec(model: nn.Module) -> PermutationSpec:
    """Spec of a network whose modules are registered in forward order and form a chain
    conv → [BN] → channel-wise ops → conv ... → flatten → first ``nn.Linear`` (naïve Inception
    modules allowed: their branches concatenate with the pooled input).

    Only for models known to satisfy that (the function-preservation tests check each one).
    """
    b = _Builder(model)
    segments: list[tuple[str, int]] = []  # the channels of the current feature map: (group, offset)
    for name, m in _forward_leaves(model):
        if isinstance(m, nn.Conv2d):
            b.consume(segments, f"{name}.weight")
            segments = [(b.new_group(name), 0)]
        elif isinstance(m, nn.BatchNorm2d):
            for group, offset in segments:
                b.add_norm(group, name, offset)
        elif isinstance(m, NaiveInception):
            branches = [f"{name}.branch1", f"{name}.branch3", f"{name}.branch5"]
            for br in branches:
                b.consume(segments, f"{br}.weight")
            width, new = 0, []
            for br in branches:
                new.append((b.new_group(br), width))
                width += b.modules[br].out_channels
            segments = new + [(g, width + off) for g, off in segments]
        elif isinstance(m, nn.Linear):
            channels = sum(b.groups[g]["size"] for g, _ in segments)
            if m.in_features % channels:
                raise ValueError(
                    f"{name}: {m.in_features} inputs are not a whole number of blocks of {channels} channels"
                )
            b.consume(segments, f"{name}.weight", m.in_features // channels)
            return b.spec()
        elif not isinstance(m, _CHANNELWISE):
            raise TypeError(f"no permutation rule for {name} ({type(m).__name__})")
    raise ValueError(f"{type(model).__name__}: no linear layer after the convolutions")


def resnet_spec(model: ResNet) -> PermutationSpec:
    """One group per residual stream (the stem and every block's last conv, plus the downsample
    conv that opens a stream), one per inner conv of each block; the last stream feeds ``fc``."""
    b = _Builder(model)
    stream = b.new_group("conv1")
    b.add_norm(stream, "bn1")
    for li in range(1, 5):
        for bi, block in enumerate(getattr(model, f"layer{li}")):
            p = f"layer{li}.{bi}"
            convs = ["conv1", "conv2"] + (["conv3"] if isinstance(block, Bottleneck) else [])
            if not isinstance(block, (BasicBlock, Bottleneck)):
                raise TypeError(f"{p}: unknown residual block {type(block).__name__}")
            b.consume([(stream, 0)], f"{p}.conv1.weight")
            if block.downsample is not None:
                b.consume([(stream, 0)], f"{p}.downsample.0.weight")
                stream = b.new_group(f"{p}.downsample.0")
                b.add_norm(stream, f"{p}.downsample.1")
            for k, conv in enumerate(convs[:-1]):
                inner = b.new_group(f"{p}.{conv}")
                b.add_norm(inner, f"{p}.bn{k + 1}")
                b.consume([(inner, 0)], f"{p}.{convs[k + 1]}.weight")
            b.add_producer(stream, f"{p}.{convs[-1]}", f"{p}.bn{len(convs)}")
    b.consume([(stream, 0)], "fc.weight")
    return b.spec()


def efficientnet_spec(model: EfficientNetLite) -> PermutationSpec:
    """One group per residual stream (the stem; a block's project conv opens a new stream when the
    width changes and joins the stream when the block has a skip connection) and one per block's
    expanded width, produced by the 1×1 expand conv *and* the depthwise conv (a depthwise conv's
    filter ``i`` reads only channel ``i``, so its output channels are its input channels, permuted
    together; BatchNorms ``_bn0`` and ``_bn1`` follow) and consumed by the project conv. Block 0 has
    no expand conv: its depthwise conv produces the stem's stream. The head conv is a group of its
    own, consumed by ``_fc``."""
    b = _Builder(model)
    stream = b.new_group("_conv_stem")
    b.add_norm(stream, "_bn0")
    for i, block in enumerate(model._blocks):
        p = f"_blocks.{i}"
        hidden = stream
        if block._expand_conv is not None:
            b.consume([(stream, 0)], f"{p}._expand_conv.weight")
            hidden = b.new_group(f"{p}._expand_conv")
            b.add_norm(hidden, f"{p}._bn0")
        b.add_producer(hidden, f"{p}._depthwise_conv", f"{p}._bn1")
        b.consume([(hidden, 0)], f"{p}._project_conv.weight")
        if block.skip:
            b.add_producer(stream, f"{p}._project_conv", f"{p}._bn2")
        else:
            stream = b.new_group(f"{p}._project_conv")
            b.add_norm(stream, f"{p}._bn2")
    b.consume([(stream, 0)], "_conv_head.weight")
    head = b.new_group("_conv_head")
    b.add_norm(head, "_bn1")
    b.consume([(head, 0)], "_fc.weight")
    return b.spec()


def unet_spec(model: UNet) -> PermutationSpec:
    """Two groups per conv block (encoders, bottleneck, decoders): its first conv's output (BatchNorm ``.1``,
    consumed by the second conv ``.3``) and the block's output (the second conv, BatchNorm ``.4``). An encoder
    block's output feeds the next block (or the bottleneck) *and*, through the skip connection, the input slice
    ``[c, 2c)`` of the first conv of the decoder at its resolution; each 2×2 transposed conv ``upconvs.j`` is a
    group of its own (weight in conv layout ``[out, in, 2, 2]``, bias) that reads the previous block's output and
    fills the slice ``[0, c)`` of that decoder conv. The last decoder block feeds the 1×1 ``classifier``, whose
    outputs (the classes) are never permuted. Groups are listed in forward order, so the spec is acyclic."""
    b = _Builder(model)

    def block(prefix: str, inputs: list[tuple[str, int]]) -> str:
        b.consume(inputs, f"{prefix}.0.weight")
        hidden = b.new_group(f"{prefix}.0")
        b.add_norm(hidden, f"{prefix}.1")
        b.consume([(hidden, 0)], f"{prefix}.3.weight")
        out = b.new_group(f"{prefix}.3")
        b.add_norm(out, f"{prefix}.4")
        return out

    x: list[tuple[str, int]] = []  # the channels of the current feature map (the image's: never permuted)
    skips = []
    for k in range(len(model.encoders)):
        skips.append(block(f"encoders.{k}", x))
        x = [(skips[-1], 0)]
    x = [(block("bottleneck", x), 0)]
    for j, skip in enumerate(reversed(skips)):
        b.consume(x, f"upconvs.{j}.weight")  # UpConv2x2 keeps its weight as [out, in, 2, 2]: inputs on dim 1
        up = b.new_group(f"upconvs.{j}")
        x = [(block(f"decoders.{j}", [(up, 0), (skip, b.groups[up]["size"])]), 0)]  # cat((up-sampled, skip))
    b.consume(x, "classifier.weight")
    return b.spec()


def mlp_spec(model: BagOfWordsMLP) -> PermutationSpec:
    """One group: the hidden units (``hidden.0`` rows and bias, ``classifier`` columns)."""
    b = _Builder(model)
    b.consume([(b.new_group("hidden.0"), 0)], "classifier.weight")
    return b.spec()


def _rows(key: str, bias: bool, block: int = 1) -> list[Axis]:
    """The output rows of linear layer ``key`` (and its bias), ``block`` rows per channel."""
    return [Axis(f"{key}.weight", 0, block=block)] + ([Axis(f"{key}.bias", 0, block=block)] if bias else [])


def transformer_spec(model: TextTransformer) -> PermutationSpec:
    """Per encoder layer, the symmetries of a transformer block (the residual stream, embeddings, LayerNorms and the
    classification head stay unpermuted):

    - ``<layer>.ffn``: the feed-forward block's hidden units, ``intermediate.dense`` rows and bias ↔
      ``output.dense`` columns (GELU is element-wise);
    - ``<layer>.heads``: whole attention heads, the same head permutation for the query, key and value rows (each
      head's ``head_dim`` rows kept in order: ``Axis.block``) and for the attention output projection's input
      columns; scores are per head, so permuting heads permutes ``softmax(q kᵀ) v``'s head blocks only. DeBERTa's
      disentangled attention reads relative positions through ``query_proj``/``key_proj`` (``share_att_key``) or its
      own ``pos_query_proj``/``pos_key_proj``, reshaped into the same heads: their rows move with the heads too.

    FOT matches heads by their query, key and value rows together (three producers), FFN units by
    ``intermediate.dense`` rows."""
    config = model.config
    heads = int(config.num_attention_heads)
    head_dim = int(config.hidden_size) // heads
    base = model.hf.base_model_prefix
    modules = dict(model.named_modules())
    groups = []
    for i in range(int(config.num_hidden_layers)):
        p = f"hf.{base}.encoder.layer.{i}"
        att = f"{p}.attention.self"
        qkv = [f"{att}.{n}" for n in ("query", "key", "value", "query_proj", "key_proj", "value_proj")
               if f"{att}.{n}" in modules]
        rel = [f"{att}.{n}" for n in ("pos_query_proj", "pos_key_proj") if f"{att}.{n}" in modules]
        if len(qkv) != 3:
            raise TypeError(f"{att}: expected query, key and value projections, found {qkv}")
        members = [a for k in qkv + rel for a in _rows(k, modules[k].bias is not None, head_dim)]
        members.append(Axis(f"{p}.attention.output.dense.weight", 1, block=head_dim))
        groups.append(PermGroup(f"{p}.heads", heads, tuple(f"{k}.weight" for k in qkv), tuple(members)))
        up, down = f"{p}.intermediate.dense", f"{p}.output.dense"
        size = modules[up].out_features
        members = [*_rows(up, modules[up].bias is not None), Axis(f"{down}.weight", 1)]
        groups.append(PermGroup(f"{p}.ffn", size, (f"{up}.weight",), tuple(members)))
    return PermutationSpec(tuple(groups))


SpecBuilder = Callable[[nn.Module], PermutationSpec]

#: zoo class -> spec builder; :func:`register_spec` adds models defined elsewhere
SPEC_BUILDERS: dict[type[nn.Module], SpecBuilder] = {
    LeNet: sequential_spec,
    SmallCNN: sequential_spec,  # CNN4 too
    HFedFCNN: sequential_spec,
    AlexNet: sequential_spec,
    VGG: sequential_spec,
    ResNet: resnet_spec,  # type: ignore[dict-item]
    EfficientNetLite: efficientnet_spec,  # type: ignore[dict-item]
    UNet: unet_spec,  # type: ignore[dict-item]
    BagOfWordsMLP: mlp_spec,  # type: ignore[dict-item]
    TextTransformer: transformer_spec,  # type: ignore[dict-item]
}


def register_spec(cls: type[nn.Module], builder: SpecBuilder) -> None:
    SPEC_BUILDERS[cls] = builder


def permutation_spec(model: nn.Module) -> PermutationSpec:
    """The spec of ``model``, or of the outermost registered model nested inside it (a wrapper such
    as FedSR's keeps the zoo model as a submodule), with keys prefixed accordingly."""
    for name, m in model.named_modules():
        for cls, builder in SPEC_BUILDERS.items():
            if isinstance(m, cls):
                return builder(m).prefixed(f"{name}." if name else "")
    raise TypeError(f"no permutation spec for {type(model).__name__}; register one in feddg/models/permutation.py")
