"""nn.TransformerEncoder's fast path (eval mode, no grad, a padding mask)
packs the batch into a strided nested tensor on cpu, cuda and the
PrivateUse1 device alike. On kiln it runs, giving CPU's numbers bit for bit
(Note [nn.TransformerEncoder's nested fast path on kiln]); before, it raised
"Internal error: NestedTensorImpl doesn't support sizes"."""

import pytest
import torch
import torch.nn as nn

FAST_PATH_OPS = ("aten::_nested_tensor_from_mask", "aten::_transformer_encoder_layer_fwd",
                 "aten::to_padded_tensor")


def _encoder_and_batch(batch_first, norm_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first,
                                       norm_first=norm_first)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(3, 7, 16) if batch_first else torch.randn(7, 3, 16)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[1, 5:] = True
    padding[2, 2:] = True
    return encoder, x, padding


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
def test_encoder_fast_path_with_padding_mask_matches_cpu(device, side_stream):
    encoder, x, padding = _encoder_and_batch(batch_first=True, norm_first=False)
    with torch.no_grad():
        expected = encoder(x, src_key_padding_mask=padding)
        encoder.to(device)
        torch.kiln.clear_op_tracking()
        stream = torch.kiln.Stream(device=device) if side_stream else None
        if stream is not None:
            stream.wait_stream(torch.kiln.current_stream(device))
        with torch.kiln.stream(stream):
            out = encoder(x.to(device), src_key_padding_mask=padding.to(device))
        if stream is not None:
            torch.kiln.current_stream(device).wait_stream(stream)
    assert out.device == torch.device(device) and not out.is_nested
    assert torch.equal(out.cpu(), expected)  # padded positions are 0 on both
    synced = torch.kiln.get_sync_ops()
    assert all(op in synced for op in FAST_PATH_OPS), synced  # the fast path was taken


@pytest.mark.parametrize("case", ["nested-off", "seq-first", "pre-norm"])
def test_encoder_without_fast_path_is_unchanged(case):
    """Where PyTorch's fast path is not taken (enable_nested_tensor=False,
    batch_first=False, norm_first=True), the ordinary ops run, as before."""
    encoder, x, padding = _encoder_and_batch(case != "seq-first", case == "pre-norm")
    if case == "nested-off":
        encoder.enable_nested_tensor = encoder.use_nested_tensor = False
    with torch.no_grad():
        expected = encoder(x, src_key_padding_mask=padding)
        torch.kiln.clear_op_tracking()
        out = encoder.to("kiln")(x.kiln(), src_key_padding_mask=padding.kiln())
    assert torch.equal(out.cpu(), expected)
    assert not any(op in torch.kiln.get_sync_ops() for op in FAST_PATH_OPS)
