"""Operators kiln overrides eagerly are traced as CPU traces them: the
recurrent layers and dropout take the Python decompositions CPU's traces
take.

Note [Tracing kiln's eager compositions]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
PyTorch implements some operators as compositions that pick a different path
on an accelerator than on the CPU. So that eager kiln gives CPU's bits, kiln
registers CPU's path as its own kernel at its autograd key
(``AutogradPrivateUse1``, and at ``PrivateUse1`` where inference_mode skips
the autograd key):

* ``aten::lstm``, ``gru``, ``rnn_tanh`` and ``rnn_relu`` (``.input``), with
  CPU's C++ compositions (``torch_kiln/csrc/aten/RecurrentLayers.cc``);
* ``aten::dropout``, with CPU's ``input * bernoulli(1 - p) / (1 - p)``, where
  an accelerator takes the fused ``native_dropout``
  (``torch_kiln/csrc/aten/Dropout.cc``).

When AOTAutograd or ``make_fx`` traces with the Python dispatcher, a CPU
tensor instead reaches PyTorch's Python decompositions of these operators
(``torch._decomp.decompositions``: ``lstm_impl``, ``gru_impl``,
``rnn_tanh_input``, ``rnn_relu_input``, ``dropout``; registered with
``py_impl`` for the CompositeImplicitAutograd and Autograd keys), while a
kiln tensor found kiln's C++ kernel at AutogradPrivateUse1 first. The graphs
then differed node for node, so compiled kiln could not give compiled CPU's
bits:

* the recurrent layers: CPU's decomposition keeps (1, B, H) hidden states;
* dropout: CPU's trace calls ``native_dropout``. Inductor's default
  (``fallback_random=False``) decomposes that into ``rand_like(x) > p``,
  kiln's composition into ``rand_like(x) < 1 - p``: the same draws gave
  complementary masks, so every compiled model with dropout (Hugging Face's
  GPT-2 at its default 0.1) trained to other losses on kiln than on the CPU
  from the first step. With ``fallback_random=True`` (``backend="kiln"``)
  and ``aot_eager``, the graph runs ``native_dropout``'s eager kernel, which
  draws eager's mask on both devices and scales it by ``1 / (1 - p)``
  rounded once, as CPU's trace does.

``register()`` adds the same Python functions for kiln's keys; ``py_impl``
only affects the Python dispatcher, so eager kiln keeps its C++ kernels.
With this and Inductor's concatenation on kiln (``_fix_concatenation`` in
``inductor/fixes.py``), compiled GRUs and RNNs give compiled CPU's bits
(``tests/test_recurrent.py``), and compiled dropout gives compiled CPU's
masks and values with every backend (``tests/test_compile_dynamo.py``). (The
LSTM decomposition takes oneDNN's layer only for CPU tensors without grad,
so there a traced kiln LSTM still takes the step-by-step form.)
"""

from __future__ import annotations

import torch
from torch._C import DispatchKey


def register() -> None:
    """Registers the decompositions for the keys kiln overrides (idempotent)."""
    import torch._decomp.decompositions as decompositions

    aten = torch.ops.aten
    both_keys = (DispatchKey.AutogradPrivateUse1, DispatchKey.PrivateUse1)
    for op, decomposition, keys in (
            (aten.lstm.input, decompositions.lstm_impl, both_keys),
            (aten.gru.input, decompositions.gru_impl, both_keys),
            (aten.rnn_tanh.input, decompositions.rnn_tanh_input, both_keys),
            (aten.rnn_relu.input, decompositions.rnn_relu_input, both_keys),
            # Dropout.cc overrides only the autograd key.
            (aten.dropout.default, decompositions.dropout, (DispatchKey.AutogradPrivateUse1,))):
        for key in keys:
            if key not in op.py_kernels:
                op.py_impl(key)(decomposition)
