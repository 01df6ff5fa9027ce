"""What the strategy does with gradients and autograd graphs outside DistributedDataParallel's own reduction:
averaging gradients held when the model is wrapped again, clearing a comm hook's per-bucket state for new
buckets, and telling whether a loss reaches any parameter. Framework-free (torch only, no Lightning)."""
from __future__ import annotations

from itertools import chain
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.autograd.function import BackwardCFunction
from torch.nn import Parameter

# Gradients averaged at a re-wrap go through flat buffers of at most this size (DDP's default bucket size):
# the buffer is a copy, made while the old wrapper's buckets still exist.
AVERAGE_BUFFER_BYTES = 25 * 2**20
# Gradient dtypes the ranks agree on by index when averaging gradients held on some ranks only (see
# `average_held_gradients`); any other takes the parameter's dtype.
GRAD_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128)


def reaches_a_parameter(loss: torch.Tensor) -> bool:
    """Whether ``loss``'s autograd graph may lead to an ``nn.Parameter``: a depth-first walk that stops at the
    first one, which a loss computed from a model's output reaches within a few nodes (the last layer's), or at
    a custom ``autograd.Function``, whose backward may use parameters that are not among its inputs (a reentrant
    ``torch.utils.checkpoint`` runs its segment's forward again in backward, with the layers' weights)."""
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        # (isinstance against Parameter runs a Python-level __instancecheck__: only for the nodes that have one)
        if variable is not None and isinstance(variable, Parameter):
            return True
        if isinstance(node, BackwardCFunction):
            return True
        stack.extend(next_node for next_node, _ in reversed(node.next_functions))
    return False


def restart_per_bucket_state(state: object) -> None:
    """Clear what a comm-hook state keeps per bucket index, for a wrapper with other buckets.

    ``PowerSGDState`` keeps its error feedback and low-rank memories in dicts keyed by bucket index: the
    new wrapper's bucket 0 would be added the old bucket 0's residual ("The size of tensor a (217) must
    match the size of tensor b (5)"). Cleared, error feedback and warm start begin again with the new
    buckets. Its iteration count carries on, but the new wrapper's first iteration is all-reduced
    uncompressed: DDP rebuilds its buckets after that iteration (the reason ``PowerSGDState`` refuses
    ``start_powerSGD_iter <= 1`` with error feedback or warm start), so compression resumes on the
    rebuilt buckets, as at the start of training.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    if isinstance(state, PowerSGDState):
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
        if state.use_error_feedback or state.warm_start:
            state.start_powerSGD_iter = max(state.start_powerSGD_iter, state.iter + 1)


def average_held_gradients(parameters: List[Parameter], group: Any, device: torch.device) -> None:
    """Average over ``group`` (a process group; None: the default one) the gradients that ``parameters`` hold
    (those the old wrapper reduced: trainable, and not among those DDP was told to ignore); ``device`` is where
    this rank's collectives run (its root device: CUDA for NCCL).

    They are the last step's, already averaged by the old wrapper (Lightning zeroes gradients later, inside
    the step's closure; averaging them again leaves them as they are, up to rounding), or local sums of a
    ``no_sync`` window: averaged, a newly frozen parameter's is what the optimizer steps on one process, and
    the others' are what the new wrapper's reduction at the window's end adds to. With
    ``find_unused_parameters=True`` and data-dependent routing a local sum can exist on some ranks only: the
    others take zeros, as DDP's own reduction does for a parameter unused on a rank (of the dtype and
    layout, sparse or not, of the ranks that hold one). Where no rank has a gradient it stays None. Costs
    one all-reduce of a small integer tensor, then the gradients' all-reduces in flat buffers of one
    (dtype, device) and about ``AVERAGE_BUFFER_BYTES`` each (a larger gradient gets a buffer of its own;
    sparse ones one by one: gloo only, NCCL has no sparse all-reduce), each buffer a copy of its gradients
    for the time of its all-reduce. A plain mean over the group, whatever comm hook is registered.
    """
    if not parameters:
        return
    world = dist.get_world_size(group)
    # Agree per parameter on whether any rank holds a gradient, whether any holds a sparse one, and its dtype
    # (a parameter's gradient dtype may differ from its own, torch's grad_dtype): a rank that holds none makes
    # zeros of that layout and dtype, so that every rank enters the same all-reduces.
    grads = [p.grad for p in parameters]
    kinds = torch.tensor(  # held or not, the dtype's place in GRAD_DTYPES + 1, the sparse dimensions (0: dense)
        [
            [g is not None for g in grads],
            [GRAD_DTYPES.index(g.dtype) + 1 if g is not None and g.dtype in GRAD_DTYPES else 0 for g in grads],
            [g.sparse_dim() if g is not None and g.is_sparse else 0 for g in grads],
        ],
        dtype=torch.int32,
        device=device,
    )
    dist.all_reduce(kinds, op=dist.ReduceOp.MAX, group=group)
    flat: Dict[tuple[torch.dtype, torch.device], List[List[torch.Tensor]]] = {}  # buffers' gradients, per kind
    flat_bytes: Dict[tuple[torch.dtype, torch.device], int] = {}  # the last buffer's size, per kind
    for parameter, held, kind, sparse_dim in zip(parameters, *kinds.tolist()):
        if not held:
            continue
        if parameter.grad is None:
            dtype = GRAD_DTYPES[kind - 1] if kind else parameter.dtype
            parameter.grad = torch.zeros_like(parameter, dtype=dtype)
        if sparse_dim and not parameter.grad.is_sparse:
            parameter.grad = parameter.grad.to_sparse(sparse_dim)
        grad = parameter.grad
        if grad.is_sparse:
            grad.div_(world)  # before the sum, as DDP does: a sum of float16 gradients may overflow
            dist.all_reduce(grad, group=group)
        else:
            key = (grad.dtype, grad.device)
            filled = flat_bytes.get(key, 0)
            if key not in flat or (filled and filled + grad.nbytes > AVERAGE_BUFFER_BYTES):
                flat.setdefault(key, []).append([])
                filled = 0
            flat[key][-1].append(grad)
            flat_bytes[key] = filled + grad.nbytes
    for same_kind in chain.from_iterable(flat.values()):
        buffer = torch.cat([grad.reshape(-1) for grad in same_kind]).div_(world)
        dist.all_reduce(buffer, group=group)
        for grad, averaged in zip(same_kind, buffer.split([grad.numel() for grad in same_kind])):
            grad.copy_(averaged.view_as(grad))
