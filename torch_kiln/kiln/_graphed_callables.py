"""``torch.kiln.make_graphed_callables``: graphed forward and backward passes
of modules or functions, ``torch.cuda.make_graphed_callables`` on kiln graphs.

The recipe is CUDA's (torch/cuda/graphs.py): warm each callable up on a side
stream, capture every forward graph in order, then every backward graph in
reverse order, all in one memory pool, and wrap each pair in an
``autograd.Function`` whose forward copies the arguments into the captured
static inputs and replays the forward graph, and whose backward copies the
incoming gradients into the static gradient outputs and replays the backward
graph. The same restrictions apply: arguments are tensors only, passed in the
order and format of ``sample_args`` (a call with another number of arguments,
or tensors of another shape, dtype or device, raises; so do sample_args that
are not kiln tensors); modules have no hooks when passed and
only their parameters require grad; no double backward; the outputs of one
call are overwritten by the next (they live in the graph's memory).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


def _check_callable(fn: Any, flat_args: tuple) -> None:
    if isinstance(fn, torch.nn.Module):
        if fn._backward_hooks or fn._forward_hooks or fn._forward_pre_hooks:
            raise RuntimeError(
                "make_graphed_callables: modules must not have hooks registered when they are "
                "passed (registering hooks afterwards is allowed)")
        if any(b.requires_grad for b in fn.buffers()):
            raise RuntimeError(
                "make_graphed_callables: only a module's parameters may require grad; its "
                "buffers must have requires_grad=False")
    if not all(isinstance(a, torch.Tensor) for a in flat_args):
        raise TypeError("make_graphed_callables: sample_args may only contain tensors, got "
                        + ", ".join(sorted({type(a).__name__ for a in flat_args})))
    other = sorted({str(a.device) for a in flat_args if a.device.type != "kiln"})
    if other:
        # Nothing on another device is captured: the graphed callable would
        # return the capture-time outputs forever.
        raise RuntimeError("make_graphed_callables: sample_args must be kiln tensors (a kiln "
                           f"graph captures only kiln work), got tensors on {', '.join(other)}")


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def _check_call_args(flat: tuple, surface: tuple, n_user_args: int) -> None:
    """Arguments of a graphed callable must match its sample_args: same count,
    and tensors of the same shape, dtype and device (they are copied into the
    captured inputs; CUDA's copy_ would broadcast or convert silently)."""
    if len(flat) != n_user_args:
        raise TypeError(f"graphed callable (make_graphed_callables) takes {n_user_args} tensor "
                        f"argument(s), like its sample_args, got {len(flat)}")
    for i, (arg, static) in enumerate(zip(flat, surface)):
        if not isinstance(arg, torch.Tensor):
            raise TypeError(f"graphed callable (make_graphed_callables): argument {i} must be a "
                            f"{_describe(static)}, like its sample arg, got "
                            f"{type(arg).__name__}")
        if arg.shape != static.shape or arg.dtype != static.dtype or arg.device != static.device:
            raise ValueError(f"graphed callable (make_graphed_callables): argument {i} must be a "
                             f"{_describe(static)}, like its sample arg (the graph was captured "
                             f"for it), got a {_describe(arg)}")


def _grads(outputs, inputs, grad_outputs, allow_unused):
    return torch.autograd.grad(outputs=outputs, inputs=inputs, grad_outputs=grad_outputs,
                               only_inputs=True, allow_unused=allow_unused)


def make_graphed_callables(callables: Any, sample_args: Any, num_warmup_iters: int = 3,
                           allow_unused_input: bool = False, pool: Any = None) -> Any:
    """Graphed versions of ``callables`` (a module or function, or a tuple of them, with
    ``sample_args`` a tuple of tensors, or a tuple of such tuples, one per callable).

    Returns the callable (modules are returned with a graphed ``forward`` used while
    their ``training`` flag is what it was at capture), or a tuple of them.
    Raises RuntimeError under autocast with its cache enabled (as CUDA), and for the
    conditions in the module docstring.
    """
    from torch_kiln.kiln import current_stream, graph, graph_pool_handle, stream, synchronize
    from torch_kiln.kiln import KilnGraph

    if torch.is_autocast_enabled("kiln") and torch.is_autocast_cache_enabled():
        raise RuntimeError("make_graphed_callables does not support the autocast cache: use "
                           "torch.autocast('kiln', cache_enabled=False)")
    single = not isinstance(callables, tuple)
    if single:
        callables, sample_args = (callables,), (sample_args,)
    flat_args = [tuple(pytree.arg_tree_leaves(*args)) for args in sample_args]
    for fn, args in zip(callables, flat_args):
        _check_callable(fn, args)
    params = [tuple(fn.parameters()) if isinstance(fn, torch.nn.Module) else () for fn in callables]
    surfaces = [args + p for args, p in zip(flat_args, params)]
    fwd_graphs = [KilnGraph() for _ in callables]
    bwd_graphs = [KilnGraph() for _ in callables]
    mempool = graph_pool_handle() if pool is None else pool

    # Warm-up on the stream the captures use (kiln's first call of an op
    # checks its meta kernel synchronously, which a capture refuses). The
    # same stream, unlike CUDA's separate one: the parameters' AccumulateGrad
    # nodes remember the stream of their first backward, and a capture on
    # another stream would need cross-stream events, which kiln does not
    # capture yet.
    synchronize()
    side = graph._default_capture_stream()
    side.wait_stream(current_stream())
    with stream(side):
        for fn, args, surface in zip(callables, sample_args, surfaces):
            for _ in range(num_warmup_iters):
                outputs = pytree.tree_leaves(fn(*args))
                needs = tuple(o for o in outputs if o.requires_grad)
                if needs:
                    _grads(needs, tuple(i for i in surface if i.requires_grad),
                           tuple(torch.empty_like(o) for o in needs), allow_unused_input)
            del outputs
    current_stream().wait_stream(side)
    synchronize()

    static_outputs, specs = [], []
    for fn, args, fwd in zip(callables, sample_args, fwd_graphs):
        with graph(fwd, pool=mempool, stream=side):
            outputs = fn(*args)
        flat, spec = pytree.tree_flatten(outputs)
        static_outputs.append(tuple(flat))
        specs.append(spec)

    # Backward graphs in reverse order, as autograd would run them.
    static_grad_outputs, static_grad_inputs = [None] * len(callables), [None] * len(callables)
    for k in reversed(range(len(callables))):
        grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None
                             for o in static_outputs[k])
        needs = tuple(o for o in static_outputs[k] if o.requires_grad)
        grad_inputs = None
        if needs:
            with graph(bwd_graphs[k], pool=mempool, stream=side):
                grad_inputs = _grads(needs, tuple(i for i in surfaces[k] if i.requires_grad),
                                     tuple(g for g in grad_outputs if g is not None),
                                     allow_unused_input)
        it = iter(grad_inputs or ())
        static_grad_inputs[k] = tuple(next(it) if i.requires_grad and grad_inputs is not None else None
                                      for i in surfaces[k])
        static_grad_outputs[k] = grad_outputs

    results = []
    for k, fn in enumerate(callables):
        graphed = _graphed_function(fwd_graphs[k], bwd_graphs[k], params[k], len(flat_args[k]),
                                    specs[k], surfaces[k], static_outputs[k],
                                    static_grad_outputs[k], static_grad_inputs[k])
        if isinstance(fn, torch.nn.Module):
            fn.forward = _graphed_forward(fn, fn.training, graphed, fn.forward)
            results.append(fn)
        else:
            results.append(graphed)
    return results[0] if single else tuple(results)


def _graphed_function(fwd, bwd, module_params, n_user_args, spec, surface, static_outputs,
                      static_grad_outputs, static_grad_inputs):
    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for i in range(n_user_args):
                if surface[i].data_ptr() != inputs[i].data_ptr():
                    surface[i].copy_(inputs[i])
            fwd.replay()
            return tuple(o.detach() for o in static_outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            for static, grad in zip(static_grad_outputs, grads):
                if static is not None and grad is not None and static.data_ptr() != grad.data_ptr():
                    static.copy_(grad)
            bwd.replay()
            return tuple(g.detach() if g is not None else None for g in static_grad_inputs)

    # The graphs live as long as the function that replays them.
    Graphed._kiln_graphs = (fwd, bwd)

    def functionalized(*user_args):
        flat = tuple(pytree.arg_tree_leaves(*user_args))
        _check_call_args(flat, surface, n_user_args)
        return pytree.tree_unflatten(Graphed.apply(*(flat + module_params)), spec)

    return functionalized


def _graphed_forward(module, training_at_capture, graphed, original_forward):
    def forward(*args, **kwargs):
        if module.training == training_at_capture:
            return graphed(*args, **kwargs)
        return original_forward(*args, **kwargs)

    return forward
