"""The local training loop every client method shares: optimiser, epochs, a loss hook (by default the task's loss
of the model's output, ``ctx.task.loss``), the configured mixed precision (``optim.amp``: the loss is computed
under ``ctx.autocast()``, fp16 with a gradient scaler; the weights and the optimiser stay float32), and the
configured local augmentations (``optim.augment``: :mod:`feddg.algorithms.components.augment`; label-mixing ones
hand ``loss_fn`` soft targets)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from feddg.algorithms.base import ClientContext, OptimSettings
from feddg.algorithms.components.augment import Augmenter, parse_augment
from feddg.devices import Inputs, images
from feddg.numerics import adam

#: ``loss_fn(model, x, y) -> scalar loss``
LossFn = Callable[[nn.Module, Inputs, Tensor], Tensor]


def task_loss(ctx: ClientContext) -> LossFn:
    """The task's loss of the model's output: every method's objective unless it adds terms."""
    return lambda model, x, y: ctx.task.loss(model(x), y)


def make_optimizer(params: Iterable[Tensor], optim: OptimSettings, lr: float) -> torch.optim.Optimizer:
    """SGD (with momentum), Adam (L2 weight decay) or AdamW (decoupled weight decay); Adam's β1 is
    ``optim.momentum``."""
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    betas = (optim.momentum, 0.999)
    if optim.name == "adam":
        return adam(params, lr=lr, betas=betas, weight_decay=optim.weight_decay)
    if optim.name == "adamw":
        return adam(params, decoupled=True, lr=lr, betas=betas, weight_decay=optim.weight_decay)
    raise ValueError(f"unknown optimiser {optim.name!r}; expected sgd, adam or adamw")


def grad_scaler(ctx: ClientContext) -> torch.amp.GradScaler:
    """The loss scaler of ``optim.amp``: on for fp16 (whose small gradients underflow), a pass-through otherwise."""
    return torch.amp.GradScaler(ctx.device.type, enabled=ctx.optim.amp == "fp16")


#: edits the gradients in place between backward and the step (SCAFFOLD's and MTGC's corrections)
GradEdit = Callable[[], None]


def scaled_step(loss: Tensor, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                edit_grads: GradEdit | None = None, clip: float | None = None) -> bool:
    """Backward and step through ``scaler`` (plain ``loss.backward(); opt.step()`` when it is disabled).
    ``edit_grads`` sees the true, unscaled gradients (fp16's loss scale already divided out): a term it adds
    moves the weights by ``lr × term`` under every ``optim.amp``; ``clip`` then bounds their global L2 norm.
    Returns whether the optimiser stepped (fp16 skips a step whose gradients overflowed)."""
    scaler.scale(loss).backward()
    if edit_grads is not None or clip is not None:
        scaler.unscale_(opt)  # a no-op when the scaler is disabled
    if edit_grads is not None:
        edit_grads()
    if clip is not None:
        params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, clip)
    scale = scaler.get_scale()  # 1.0 when disabled; the scaler reads its overflow flag to the host in step anyway
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale() >= scale  # it backs the scale off exactly when it skipped the step


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def trainable(model: nn.Module, batches: Iterable[tuple[Inputs, Tensor]]) -> Iterator[tuple[Inputs, Tensor]]:
    """``batches`` without the single-sample ones when the model has BatchNorm (it cannot train on one sample)."""
    bn = has_batchnorm(model)
    return ((x, y) for x, y in batches if not (bn and len(y) < 2))


def gradient_batches(model: nn.Module, ctx: ClientContext) -> Iterator[tuple[Inputs, Tensor]]:
    """The client's batches in order, without augmentation (an extra gradient pass in training mode: SCAFFOLD's
    ``∇f_i(x)``, FedIIR's mean gradient), skipping a single-sample batch under BatchNorm as training does."""
    return trainable(model, ctx.batches(shuffle=False, train=False))


def _some(batches: Iterator[tuple[int, Inputs, Tensor]], ctx: ClientContext) -> Iterator[tuple[int, Inputs, Tensor]]:
    """``batches``, or a ``ValueError`` once they end if there was none."""
    any_batch = False
    for batch in batches:
        any_batch = True
        yield batch
    if not any_batch:
        raise ValueError(f"client {ctx.client_id} has nothing to train on: its {ctx.num_examples} example(s) make only "
                         f"one-sample batches (batch size {ctx.batch_size}), which a BatchNorm model skips")


def local_batches(model: nn.Module, ctx: ClientContext) -> Iterator[tuple[int, Inputs, Tensor]]:
    """``(epoch, x, target)`` over ``ctx.local_epochs`` epochs of the client's batches, with ``optim.augment``
    applied (its stage hooks live while the batches are drawn; the target is soft after label mixing) and
    single-sample batches skipped when the model has BatchNorm (it cannot train on one sample). A client left with
    no batch at all is refused (a ``ValueError``: the run records it as a failed client), not reported as trained
    with a loss of 0."""
    specs = parse_augment(ctx.optim.augment)
    batches = _some(((epoch, x, y) for epoch in range(ctx.local_epochs) for x, y in trainable(model, ctx.batches())),
                    ctx)
    if not specs:  # no draw, no hooks: nothing to set up (an empty Augmenter cost a client ~40 µs)
        yield from batches
        return
    seed = int(torch.randint(2**62, (1,), generator=ctx.generator))
    with Augmenter(model, specs, seed, ctx.task.num_classes) as augment:
        for epoch, x, y in batches:
            yield (epoch, *augment.step(images(x), y))


def train_steps(model: nn.Module, ctx: ClientContext, lr: float, loss_fn: LossFn | None = None,
                edit_grads: GradEdit | None = None) -> tuple[float, int]:
    """Run ``ctx.local_epochs`` epochs of ``loss_fn`` (default: the task's loss) on the client's data; return the
    mean loss over its batches and the number of optimiser steps taken (fewer than batches where fp16 skipped
    one). ``edit_grads``: see :func:`scaled_step`."""
    loss_fn = loss_fn or task_loss(ctx)
    model.train()
    opt = make_optimizer(model.parameters(), ctx.optim, lr)
    scaler = grad_scaler(ctx)
    total, batches, steps = 0.0, 0, 0
    for _, x, y in local_batches(model, ctx):
        opt.zero_grad(set_to_none=True)
        with ctx.autocast():
            loss = loss_fn(model, x, y)
        steps += scaled_step(loss, opt, scaler, edit_grads, ctx.optim.grad_clip)
        total += float(loss.detach())
        batches += 1
    return total / max(batches, 1), steps


def train_local(model: nn.Module, ctx: ClientContext, lr: float, loss_fn: LossFn | None = None,
                edit_grads: GradEdit | None = None) -> float:
    """:func:`train_steps`' mean loss."""
    return train_steps(model, ctx, lr, loss_fn, edit_grads)[0]
