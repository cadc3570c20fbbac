"""What the server checks of every client reply before folding it in (docs/reliability.md).

A reply that fails a check is dropped like one that never came: the round goes on with the others
(``federation.min_clients``), and metrics.jsonl records the client and the reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from feddg.messages import WEIGHT_PREFIX, Layout, Message, Shapes, Slot, Value, number_slot

#: what every reply may carry besides its ``w/`` arrays and whatever its method declares
COMMON: Layout = {"train_loss": number_slot(required=False)}


class RunStopped(RuntimeError):
    """The federation cannot go on (too few usable replies, no client worker can start); the run
    directory keeps its last checkpoint. The message is one line."""


def _layout(value: Value) -> tuple[tuple[int, ...], np.dtype]:
    return tuple(np.shape(value)), np.asarray(value).dtype


def shapes_of(weights: Mapping[str, Value]) -> Shapes:
    """``w/`` key -> shape and dtype of the arrays in ``weights``."""
    return {k: _layout(v) for k, v in weights.items() if k.startswith(WEIGHT_PREFIX)}


def check_reply(reply: Message, sent: Message, declared: Shapes, *, all_weights: bool,
                beside: Layout | None = None) -> str | None:
    """Why ``reply`` must not be folded in, or ``None``.

    ``sent`` is what the server sent this client, ``declared`` the shapes and dtypes of the model's ``w/``
    arrays, ``beside`` what the method reads beyond them (``Method.reply_layout``). Checks: ``num_examples`` a
    positive int; every value an array, a number or a string (a list in a Flower record is not); every float array
    and number finite; every ``w/`` array one the model declares, of the shape and dtype sent (or declared: an
    integer or complex array in a float's place escaped the finite check and the update-norm bound); with
    ``all_weights`` (methods that average the weights) exactly the ``w/`` keys sent, or all declared ones when none
    were sent; every other array one that ``beside`` declares, and every value it declares there and of its kind
    (a wrong shape crashed the server's fold, or was broadcast into it).
    """
    n = reply.get("num_examples")
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n <= 0:
        return f"num_examples is {n!r}, not a positive int"
    for key, value in reply.items():
        if not isinstance(value, np.ndarray | int | float | str | np.integer | np.floating):
            return f"{key} is a {type(value).__name__}, not an array, a number or a string"
        if (why := _not_finite(key, value)) is not None:
            return why
        if isinstance(value, float | np.floating) and not math.isfinite(value):
            return f"{key} is {value}"
    got = shapes_of(reply)
    for key, (shape, dtype) in got.items():
        want = _layout(sent[key]) if key in sent else declared.get(key)
        if want is None:
            return f"unexpected weight {key}"
        if shape != want[0]:
            return f"{key} has shape {shape}, expected {want[0]}"
        if dtype != want[1]:
            return f"{key} is {dtype}, expected {want[1]}"
    if all_weights:
        expected = [k for k in sent if k.startswith(WEIGHT_PREFIX)] or list(declared)
        missing = [k for k in expected if k not in got]
        if missing:
            return f"missing {missing[0]}" + (f" and {len(missing) - 1} more weights" if len(missing) > 1 else "")
        extra = sorted(set(got) - set(expected))
        if extra:
            return f"unexpected weight {extra[0]}"
    return _beside_problem(reply, {**COMMON, **(beside or {})})


def _not_finite(key: str, value: Value) -> str | None:
    """``NaN in key`` / ``Inf in key`` for a float or complex array that is not finite."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "fc" and not np.isfinite(value).all():
        return f"{'NaN' if np.isnan(value).any() else 'Inf'} in {key}"
    return None


def _beside_problem(reply: Message, layout: Layout) -> str | None:
    groups = [k for k in layout if k.endswith("/")]
    for key, value in reply.items():
        if key.startswith(WEIGHT_PREFIX) or key == "num_examples":
            continue
        slot = layout.get(key) or next((layout[g] for g in groups if key.startswith(g)), None)
        if slot is None:
            if isinstance(value, np.ndarray):
                return f"unexpected array {key}"
            continue  # a number or string the method does not read (a client's metric)
        if (why := _slot_problem(value, slot)) is not None:
            return f"{key} {why}"
    missing = [k for k, slot in layout.items() if slot.required and k not in groups and k not in reply]
    return None if not missing else f"missing {missing[0]}"


def _slot_problem(value: Value, slot: Slot) -> str | None:
    if slot.number:
        if isinstance(value, bool | np.ndarray | str) or not isinstance(value, int | float | np.number):
            return f"is {value!r}, not a number"
        if slot.dtype.kind in "iu" and not isinstance(value, int | np.integer):
            return f"is {value!r}, not an int"
        if slot.value is not None and float(value) != slot.value:
            return f"is {value!r}, sent {slot.value!r}"
        return None
    if not isinstance(value, np.ndarray):
        return f"is a {type(value).__name__}, not an array"
    if slot.shape is not None and (len(value.shape) != len(slot.shape)
                                   or any(want not in (-1, got) for got, want in zip(value.shape, slot.shape))):
        return f"has shape {value.shape}, expected {_shape_text(slot.shape)}"
    if value.dtype != slot.dtype:
        return f"is {value.dtype}, expected {slot.dtype}"
    return None


def update_norm(reply: Message, sent: Message) -> float:
    """``‖w_k − w_sent‖`` over the float ``w/`` arrays the reply shares with what was sent, in float64."""
    total = 0.0
    for key, value in reply.items():
        if key.startswith(WEIGHT_PREFIX) and key in sent and np.asarray(value).dtype.kind == "f":
            diff = np.asarray(value, dtype=np.float64) - np.asarray(sent[key], dtype=np.float64)
            total += float(np.dot(diff.ravel(), diff.ravel()))
    return math.sqrt(total)


def outliers(norms: Mapping[int, float], factor: float) -> dict[int, str]:
    """Clients whose update norm exceeds ``factor`` × the median of ``norms``, with the reason."""
    if not norms:
        return {}
    median = float(np.median(list(norms.values())))
    return {cid: f"update norm {n:.4g} > {factor:g} x median {median:.4g}"
            for cid, n in norms.items() if n > factor * median}


def _shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join("any" if d == -1 else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def check_setup_replies(replies: Mapping[int, Message], layout: Layout) -> dict[int, str]:
    """Client id -> why its setup reply must not reach the method's ``server_setup``: a value it does not declare or
    of another kind, a float not finite, or an array whose sizes left open (-1) past the first dimension differ from
    the other clients' (the method stacks them)."""
    problems = {}
    for cid, msg in replies.items():
        why = next((w for key, value in msg.items() if (w := _not_finite(key, value)) is not None), None)
        if (why := why or _beside_problem(msg, layout)) is not None:
            problems[cid] = why
    for key, slot in layout.items():
        open_dims = [i for i, d in enumerate((slot.shape or ())[1:], start=1) if d == -1]
        sizes = {cid: tuple(np.shape(msg[key])[i] for i in open_dims)
                 for cid, msg in replies.items() if cid not in problems and key in msg}
        if len(set(sizes.values())) > 1:  # sizes most clients share stand; without a majority none does
            common = max(set(sizes.values()), key=list(sizes.values()).count)
            if 2 * list(sizes.values()).count(common) <= len(sizes):
                problems.update({cid: f"{key} has shape {np.shape(replies[cid][key])}: the clients' shapes differ, "
                                      "none shared by most" for cid in sizes})
                continue
            problems.update({cid: f"{key} has shape {np.shape(replies[cid][key])}, the other clients' "
                                  f"{np.shape(replies[next(c for c, v in sizes.items() if v == common)][key])}"
                             for cid, v in sizes.items() if v != common})
    return problems
