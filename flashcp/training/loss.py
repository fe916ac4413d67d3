"""The loss and gradient reductions that make a CP (and data-parallel) step the one-device step.

The one-device loss of a batch is ``L = sum_i ce_i / V``, the cross-entropy summed over the
batch's V valid tokens (those with a label), divided by V. Each rank computes
``L_r = sum_{i on r} ce_i / V`` with V all-reduced over the CP group (and the data-parallel group,
when the one-device batch is every DP replica's sequences together), so ``L = sum_r L_r``. The CP
ops' backward sends each rank the gradient of every other rank's loss with respect to the keys and
values it owns, so rank r's parameter gradient is the part of ``dL/dtheta`` that flows through its
tokens; a SUM all-reduce of the parameter gradients over the same groups is then ``dL/dtheta``:
no division by the CP or DP size anywhere (docs/training.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flashcp.ops.collectives import resolve_group
from flashcp.training.batch import IGNORE_INDEX

__all__ = ["allreduce_grads", "cp_cross_entropy"]


def _groups(groups) -> list:
    """The process groups to reduce over: one group, or a sequence of them (None: the default
    group); each resolved like the ops' CP group (ProcessGroup or 1-D DeviceMesh)."""
    if groups is None or not isinstance(groups, list | tuple):
        groups = [groups]
    return [resolve_group(g) for g in groups]


def cp_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    groups=None,
    *,
    ignore_index: int = IGNORE_INDEX,
    return_per_token: bool = False,
):
    """This rank's share of the batch's mean cross-entropy: its valid tokens' sum over the
    valid tokens of every rank of ``groups``.

    The shares of the ranks add up to the one-device loss; backpropagate each rank's share, then
    :func:`allreduce_grads` over the same groups.

    Args:
        logits: (T, V) float, this rank's logits (any float dtype; the loss is in that dtype,
            float32 at least).
        labels: (T,) int64, ``ignore_index`` where a token has no target.
        groups: a process group (None: the default group), a 1-D DeviceMesh, or a list of them
            (e.g. ``[cp_group, dp_group]``: reduced over each in turn, which covers their product
            when they are orthogonal). ``[]``: this rank only.
        return_per_token: also return the (T,) per-token losses (0 where ignored).
    Returns:
        0-d tensor, differentiable (and the per-token losses when asked).
    Raises:
        ValueError: shapes, dtypes or label values that do not match, on this rank or any rank of
            the groups (every rank raises: the count's all-reduce carries a flag), or no valid
            token in the whole groups' batch.
    """
    problem = _loss_input_problem(logits, labels, ignore_index)
    count = (
        (labels != ignore_index).sum() if problem is None else torch.zeros((), dtype=torch.int64)
    )
    # the count travels with a flag of bad input, so a rank's bad input fails every rank of the
    # groups at once (no peer left waiting in the next collective)
    flags = torch.stack([count.to(torch.int64).cpu(), torch.tensor(int(problem is not None))])
    flags = flags.to(logits.device if isinstance(logits, torch.Tensor) else "cpu")
    for g in _groups(groups):
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=g)
    if problem is not None:
        raise ValueError(problem)
    if int(flags[1]):
        raise ValueError(
            f"{int(flags[1])} peer rank(s) passed bad logits or labels (see their errors)"
        )
    total = flags[0]
    if int(total) == 0:
        raise ValueError("no token with a label in the groups' batch: the mean loss is undefined")
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    per_token = F.cross_entropy(x, labels, ignore_index=ignore_index, reduction="none")
    loss = per_token.sum() / total.to(per_token.dtype)
    return (loss, per_token) if return_per_token else loss


def _loss_input_problem(logits, labels, ignore_index: int) -> str | None:
    """What is wrong with one rank's loss inputs (a message), or None."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        return f"logits must be a (T, V) float tensor, got {getattr(logits, 'shape', logits)}"
    if (
        not isinstance(labels, torch.Tensor)
        or labels.dim() != 1
        or labels.shape[0] != logits.shape[0]
        or labels.dtype != torch.int64
    ):
        return (
            f"labels must be ({logits.shape[0]},) int64 to match logits {tuple(logits.shape)}, "
            f"got {getattr(labels, 'shape', labels)} {getattr(labels, 'dtype', '')}"
        )
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= logits.shape[1]))
    if bool(bad.any()):
        return f"label {int(labels[bad][0])} out of range for vocabulary size {logits.shape[1]}"
    return None


def allreduce_grads(params, groups=None) -> None:
    """SUM all-reduce of the parameters' gradients over ``groups``, in place (no rescaling).

    A parameter without a gradient on this rank (e.g. a rank holding only pad) gets zeros first,
    so every rank makes the same collectives. The gradients travel in one flat buffer per dtype
    and device.

    Args:
        params: an ``nn.Module`` or an iterable of parameters (the same, in the same order, on
            every rank).
        groups: as :func:`cp_cross_entropy`.
    Raises:
        ValueError: a parameter that does not require grad, a bad group, or ranks whose
            parameters differ in number of elements (on every rank, before the reduction).
    """
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    params = list(params) if isinstance(params, Iterable) else params
    for p in params:
        if not p.requires_grad:
            raise ValueError(f"parameter of shape {tuple(p.shape)} does not require grad")
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    groups = _groups(groups)
    if not dist.is_initialized() or not groups:
        return
    _check_same_sizes(params, groups)
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        for g in groups:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=g)
        _unflatten(flat, grads)


def _check_same_sizes(params, groups) -> None:
    """Raise ValueError on every rank when the ranks' gradients differ in size (different models
    would otherwise fail or hang inside the reduction): the min and max element counts, reduced."""
    numel = sum(p.numel() for p in params)
    device = params[0].grad.device if params else "cpu"
    for g in groups:
        bounds = torch.tensor([numel, -numel], dtype=torch.int64, device=device)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=g)
        if int(bounds[0]) != numel or int(-bounds[1]) != numel:
            raise ValueError(
                f"the ranks' parameters differ: {int(-bounds[1])} to {int(bounds[0])} elements "
                f"(this rank: {numel}); every rank must pass the same parameters, in one order"
            )


def _unflatten(flat: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``grads`` (their sizes in order)."""
    off = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[off : off + n].view_as(g))
        off += n
