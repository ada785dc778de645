"""Recurrent layers traced on kiln take the Python decompositions CPU's
traces take.

Note [Tracing kiln's recurrent layers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Eagerly, kiln registers ``aten::lstm``, ``gru``, ``rnn_tanh`` and
``rnn_relu`` (``.input``) for its autograd and backend keys, with CPU's C++
compositions (``torch_kiln/csrc/aten/RecurrentLayers.cc``). When
AOTAutograd or ``make_fx`` traces with the Python dispatcher, a CPU tensor
instead reaches PyTorch's Python decompositions of these operators
(``torch._decomp.decompositions``: ``lstm_impl``, ``gru_impl``,
``rnn_tanh_input``, ``rnn_relu_input``, registered with ``py_impl`` for the
CompositeImplicitAutograd and Autograd keys), while a kiln tensor found
kiln's C++ kernel at AutogradPrivateUse1 first. The graphs differed node for
node (CPU's decomposition keeps (1, B, H) hidden states), so a compiled
kiln layer (``torch._dynamo.config.allow_rnn``) could not give compiled
CPU's bits. ``register()`` adds the same Python functions for kiln's two
keys; ``py_impl`` only affects the Python dispatcher, so eager kiln keeps
its C++ kernels. With this and Inductor's concatenation on kiln
(``_fix_concatenation`` in ``inductor/fixes.py``), compiled GRUs and RNNs
give compiled CPU's bits (``tests/test_recurrent.py``). (The LSTM
decomposition takes oneDNN's layer only for CPU tensors without grad, so
there a traced kiln LSTM still takes the step-by-step form.)
"""

from __future__ import annotations

import torch
from torch._C import DispatchKey

_KEYS = (DispatchKey.AutogradPrivateUse1, DispatchKey.PrivateUse1)


def register() -> None:
    """Registers the decompositions for kiln's keys (idempotent)."""
    import torch._decomp.decompositions as decompositions

    aten = torch.ops.aten
    for op, decomposition in ((aten.lstm.input, decompositions.lstm_impl),
                              (aten.gru.input, decompositions.gru_impl),
                              (aten.rnn_tanh.input, decompositions.rnn_tanh_input),
                              (aten.rnn_relu.input, decompositions.rnn_relu_input)):
        for key in _KEYS:
            if key not in op.py_kernels:
                op.py_impl(key)(decomposition)
