"""Sparse COO and sparse compressed (CSR, CSC, BSR, BSC) tensors on kiln
(Note [Sparse tensors on kiln] in torch_kiln/csrc/aten/SparseTensors.cc).

Every result is compared with CPU's member by member, bit for bit: the same
nnz, the same indices in the same order, the same values, the same
coalesced flag."""

import io
import re

import pytest
import torch

from conftest import assert_same

pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
    pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled"),
]

COMPRESSED = [torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc]
LAYOUTS = [torch.sparse_coo, *COMPRESSED]


def members(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if t.layout == torch.sparse_coo:
        return t._indices(), t._values()
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices(), t.values()
    return t.ccol_indices(), t.row_indices(), t.values()


def assert_sparse_same(kiln: torch.Tensor, cpu: torch.Tensor, device: str = "kiln:0") -> None:
    assert kiln.device == torch.device(device), kiln.device
    assert kiln.layout == cpu.layout, (kiln.layout, cpu.layout)
    assert kiln.shape == cpu.shape and kiln.dtype == cpu.dtype
    assert kiln._nnz() == cpu._nnz()
    if cpu.layout == torch.sparse_coo:
        assert kiln.is_coalesced() == cpu.is_coalesced()
        assert (kiln.sparse_dim(), kiln.dense_dim()) == (cpu.sparse_dim(), cpu.dense_dim())
    for k, c in zip(members(kiln), members(cpu)):
        assert k.device == torch.device(device), "a member on another device"
        assert_same(k, c)


def to_layout(dense: torch.Tensor, layout: torch.layout) -> torch.Tensor:
    if layout == torch.sparse_coo:
        return dense.to_sparse()
    if layout in (torch.sparse_bsr, torch.sparse_bsc):
        return dense.to_sparse(layout=layout, blocksize=(2, 2))
    return dense.to_sparse(layout=layout)


def sparse_matrix(rows=4, cols=6, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, cols, generator=g)
    return dense * (torch.rand(rows, cols, generator=g) < 0.4)


def uncoalesced_coo() -> torch.Tensor:
    # Duplicate entries (0, 2) and unsorted indices: coalesce has work to do.
    indices = torch.tensor([[1, 0, 1, 0, 0], [0, 2, 2, 2, 1]])
    values = torch.tensor([4.0, 3.0, 5.0, 1.0, -2.0])
    return torch.sparse_coo_tensor(indices, values, (2, 3))


# ---------------------------------------------------------------- creation and transfer

@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_sparse_coo_tensor_from_kiln_members(device):
    cpu = uncoalesced_coo()
    kiln = torch.sparse_coo_tensor(cpu._indices().to(device), cpu._values().to(device), (2, 3))
    assert_sparse_same(kiln, cpu, device)
    made_there = torch.sparse_coo_tensor(cpu._indices(), cpu._values(), (2, 3), device=device)
    assert_sparse_same(made_there, cpu, device)


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_sparse_compressed_tensor_constructors(device):
    csr = torch.sparse_csr_tensor(torch.tensor([0, 1, 3]), torch.tensor([2, 0, 1]),
                                  torch.tensor([1.0, 2.0, 3.0]), (2, 3), device=device)
    assert_sparse_same(csr, csr.cpu(), device)
    assert_same(csr.to_dense(), torch.tensor([[0.0, 0.0, 1.0], [2.0, 3.0, 0.0]]))


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr])
def test_empty_and_zeros_with_a_sparse_layout(device, layout):
    z = torch.zeros(3, 4, layout=layout, device=device)
    assert_sparse_same(z, torch.zeros(3, 4, layout=layout), device)
    e = torch.empty(3, 4, layout=layout, device=device)
    assert (e.device, e.layout, e.shape, e._nnz()) == (torch.device(device), layout, (3, 4), 0)


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("non_blocking", [False, True])
def test_transfer_both_ways(device, layout, non_blocking):
    cpu = to_layout(sparse_matrix(), layout)
    kiln = cpu.to(device, non_blocking=non_blocking)
    assert_sparse_same(kiln, cpu, device)
    back = kiln.to("cpu", non_blocking=non_blocking)
    torch.kiln.synchronize()
    assert back.device.type == "cpu" and back.layout == layout
    for b, c in zip(members(back), members(cpu)):
        assert_same(b, c)


def test_transfer_of_a_pinned_sparse_tensor_on_a_side_stream():
    cpu = uncoalesced_coo()
    pinned = cpu.pin_memory()
    assert pinned.is_pinned()
    stream = torch.kiln.Stream()
    with torch.kiln.stream(stream):
        kiln = pinned.to("kiln", non_blocking=True)
        total = (kiln + kiln).to_dense()
    stream.synchronize()
    assert_same(total, (cpu + cpu).to_dense())


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_dense_to_sparse_on_kiln(layout):
    dense = sparse_matrix()
    kiln = dense.to("kiln")
    assert_sparse_same(to_layout(kiln, layout), to_layout(dense, layout))
    assert_same(to_layout(kiln, layout).to_dense(), to_layout(dense, layout).to_dense())


@pytest.mark.parametrize("side_stream", [False, True])
def test_to_sparse_sees_work_queued_before_it(side_stream):
    stream = torch.kiln.Stream() if side_stream else torch.kiln.current_stream()
    with torch.kiln.stream(stream):
        busy = torch.randn(384, 384, device="kiln")
        for _ in range(4):
            busy = busy @ busy  # keeps the stream busy, so the add below is still queued
        x = torch.zeros(4, 6, device="kiln")
        x.add_(sparse_matrix().to("kiln"))
        assert_sparse_same(x.to_sparse(), sparse_matrix().to_sparse())
        assert_sparse_same(x.to_sparse_csr(), sparse_matrix().to_sparse_csr())


# ---------------------------------------------------------------- compute

def test_coalesce_matches_cpu():
    cpu = uncoalesced_coo()
    kiln = cpu.to("kiln")
    assert not kiln.is_coalesced()
    assert_sparse_same(kiln.coalesce(), cpu.coalesce())
    assert kiln.coalesce().is_coalesced()


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_to_dense(layout):
    cpu = to_layout(sparse_matrix(), layout)
    assert_same(cpu.to("kiln").to_dense(), cpu.to_dense())


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=str)
def test_add_sparse_and_dense(layout):
    a, b = to_layout(sparse_matrix(seed=1), layout), to_layout(sparse_matrix(seed=2), layout)
    ka, kb = a.to("kiln"), b.to("kiln")
    assert_sparse_same(ka + kb, a + b)
    assert_sparse_same(torch.add(ka, kb, alpha=2), torch.add(a, b, alpha=2))
    dense = torch.randn(4, 6)
    assert_same(dense.to("kiln") + ka, dense + a)


def test_in_place_add_that_grows_nnz():
    a, b = sparse_matrix(seed=1).to_sparse(), sparse_matrix(seed=2).to_sparse()
    ka = a.to("kiln")
    ka.add_(b.to("kiln"))
    a.add_(b)
    assert_sparse_same(ka, a)


@pytest.mark.parametrize("op", ["mul_", "add_", "neg_", "zero_", "div_", "t_"])
def test_in_place_ops_keep_or_replace_members_as_cpu_does(op):
    # CPU's mul_ and add_ give the tensor new members and leave the old ones
    # (and views of them, and other tensors built on them) alone; others
    # write into the members. Kiln must do the same either way.
    def run(device):
        values = torch.tensor([1.0, 2.0], device=device)
        a = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]], device=device), values, (2, 2))
        b = torch.sparse_coo_tensor(torch.tensor([[1, 1], [0, 1]], device=device), values, (2, 2))
        held = a._values()
        args = {"mul_": (3,), "add_": (a,), "div_": (2,)}.get(op, ())
        getattr(a, op)(*args)
        return a, b, held, values

    cpu, kiln = run("cpu"), run("kiln")
    assert_sparse_same(kiln[0], cpu[0])
    assert_sparse_same(kiln[1], cpu[1])
    assert_same(kiln[2], cpu[2])
    assert_same(kiln[3], cpu[3])


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=str)
def test_in_place_and_out_ops_under_inference_mode(layout):
    results = {}
    for device in ("cpu", "kiln"):
        made_outside = to_layout(sparse_matrix(), layout).to(device)
        with torch.inference_mode():
            made_inside = to_layout(sparse_matrix(seed=3), layout).to(device)
            made_outside.mul_(2)
            made_inside.add_(made_inside)
            out = torch.zeros(4, 6, layout=torch.sparse_coo, device=device)
            if layout == torch.sparse_coo:
                torch.add(made_inside, made_outside, out=out)
        results[device] = (made_outside, made_inside, out)
    for k, c in zip(results["kiln"], results["cpu"]):
        assert_sparse_same(k, c)


def test_dense_out_arguments_of_sparse_ops():
    # Kernels of structured ops' out= variants expect the out tensor sized.
    a = torch.tensor([[2.0, 0, 0], [1, 3, 0], [0, 1, 4]]).to_sparse_csr()
    b = torch.tensor([[2.0], [4.0], [9.0]])
    expected = torch.triangular_solve(b, a, upper=False)
    actual = torch.triangular_solve(b.to("kiln"), a.to("kiln"), upper=False)
    assert_same(actual[0], expected[0])
    x, m = torch.empty(3, 1, device="kiln"), torch.empty(0, device="kiln")
    torch.triangular_solve(b.to("kiln"), a.to("kiln"), upper=False, out=(x, m))
    assert_same(x, expected[0])
    for layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr):
        s = to_layout(torch.eye(4), layout)
        out = torch.empty(4, 2, device="kiln")
        torch.mm(s.to("kiln"), torch.ones(4, 2, device="kiln"), out=out)
        assert_same(out, torch.mm(s, torch.ones(4, 2)))


def test_complex_views_of_values():
    cpu = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1 + 2j, 3 - 1j]), (4,))
    kiln = cpu.to("kiln")
    assert_same(kiln.real.to_dense(), cpu.real.to_dense())
    assert_same(kiln.imag.to_dense(), cpu.imag.to_dense())
    assert_sparse_same(torch.view_as_real(kiln), torch.view_as_real(cpu))


@pytest.mark.parametrize("mode", ["sum", "mean"])  # CPU: "max" has no sparse weights
def test_sparse_embedding_bag_training_matches_cpu(mode):
    def train(device):
        torch.manual_seed(0)
        bag = torch.nn.EmbeddingBag(10, 3, mode=mode, sparse=True).to(device)
        opt = torch.optim.SGD(bag.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            bag(torch.tensor([1, 2, 4, 4, 7], device=device),
                torch.tensor([0, 2], device=device)).pow(2).sum().backward()
            assert bag.weight.grad.layout == torch.sparse_coo
            opt.step()
        return bag.weight.detach()

    assert_same(train("kiln"), train("cpu"))


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=str)
def test_mm_and_addmm(layout):
    s = to_layout(sparse_matrix(), layout)
    d = torch.randn(6, 5)
    bias = torch.randn(4, 5)
    ks, kd, kbias = s.to("kiln"), d.to("kiln"), bias.to("kiln")
    assert_same(torch.mm(ks, kd), torch.mm(s, d))
    assert_same(ks @ kd, s @ d)
    assert_same(torch.addmm(kbias, ks, kd, beta=0.5, alpha=2), torch.addmm(bias, s, d, beta=0.5,
                                                                           alpha=2))
    assert_same(torch.sparse.mm(ks, kd), torch.sparse.mm(s, d))


def test_sparse_sparse_mm():
    a, b = sparse_matrix(4, 6, seed=1).to_sparse(), sparse_matrix(6, 3, seed=2).to_sparse()
    assert_sparse_same(torch.sparse.mm(a.to("kiln"), b.to("kiln")), torch.sparse.mm(a, b))


def test_sampled_addmm():
    mask = to_layout(sparse_matrix(4, 5), torch.sparse_csr)
    m1, m2 = torch.randn(4, 3), torch.randn(3, 5)
    expected = torch.sparse.sampled_addmm(mask, m1, m2, beta=0.5, alpha=2)
    actual = torch.sparse.sampled_addmm(mask.to("kiln"), m1.to("kiln"), m2.to("kiln"),
                                        beta=0.5, alpha=2)
    assert_sparse_same(actual, expected)


def test_reductions_and_elementwise():
    cpu = uncoalesced_coo()
    kiln = cpu.to("kiln")
    assert_same(torch.sparse.sum(kiln), torch.sparse.sum(cpu))
    assert_sparse_same(torch.sparse.sum(kiln, dim=1), torch.sparse.sum(cpu, dim=1))
    assert_sparse_same(kiln * 2, cpu * 2)
    assert_sparse_same(kiln.neg(), cpu.neg())
    assert_sparse_same(kiln.t(), cpu.t())
    assert_sparse_same(kiln.double(), cpu.double())
    csr = cpu.to_sparse_csr()
    assert_same(csr.to("kiln").sum(), csr.sum())


def test_ops_that_pass_one_sparse_tensor_twice():
    # smm calls sspaddmm.out(result, result, ...): out= and an input alias.
    s = sparse_matrix().to_sparse()
    eye = torch.eye(6)
    assert_sparse_same(torch.smm(s.to("kiln"), eye.to("kiln")), torch.smm(s, eye))
    assert_sparse_same(torch.cat([s.to("kiln")] * 2), torch.cat([s] * 2))


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=str)
def test_copy_into_a_kiln_sparse_tensor(layout):
    cpu = to_layout(sparse_matrix(), layout)
    for source in (cpu, cpu.to("kiln"), cpu.to("kiln:1")):
        target = torch.zeros(4, 6, layout=torch.sparse_coo, device="kiln") if \
            layout == torch.sparse_coo else cpu.to("kiln").clone()
        target.copy_(source)
        assert_sparse_same(target, cpu)
    back = cpu.clone()
    back.copy_(cpu.to("kiln"))
    for b, c in zip(members(back), members(cpu)):
        assert_same(b, c)


def test_sparse_ops_are_counted_as_synchronizing():
    kiln = uncoalesced_coo().to("kiln")
    torch.kiln.clear_op_tracking()
    kiln.coalesce()
    assert torch.kiln.get_sync_ops().get("aten::_coalesce", 0) == 1


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=str)
def test_printing(layout):
    cpu = to_layout(sparse_matrix(), layout)
    text = repr(cpu.to("kiln"))
    assert "device='kiln:0'" in text
    assert re.sub(r"device='kiln:0',\s*", "", text).split() == repr(cpu).split()


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr, torch.sparse_csc],
                         ids=str)
def test_save_and_load(layout):
    cpu = to_layout(sparse_matrix(), layout)
    buffer = io.BytesIO()
    torch.save(cpu.to("kiln"), buffer)
    buffer.seek(0)
    assert_sparse_same(torch.load(buffer), cpu)
    buffer.seek(0)
    on_cpu = torch.load(buffer, map_location="cpu")
    assert on_cpu.device.type == "cpu"
    assert_same(on_cpu.to_dense(), cpu.to_dense())


# ---------------------------------------------------------------- autograd and training

def test_sparse_mm_backward():
    grads = {}
    for device in ("cpu", "kiln"):
        s = uncoalesced_coo().to(device).requires_grad_()
        d = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).to(device)
        d.requires_grad_()
        torch.sparse.mm(s, d).sum().backward()
        grads[device] = (s.grad, d.grad)
    assert grads["kiln"][0].layout == torch.sparse_coo
    assert_sparse_same(grads["kiln"][0], grads["cpu"][0])
    assert_same(grads["kiln"][1], grads["cpu"][1])


@pytest.mark.parametrize("optimizer", ["SGD", "SparseAdam"])
def test_sparse_embedding_training_matches_cpu(optimizer):
    def train(device):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 4, sparse=True).to(device)
        opt = getattr(torch.optim, optimizer)(emb.parameters(), lr=0.1)
        for step in range(3):
            idx = torch.tensor([[1, 2, 4], [4, 3, 9 - step]], device=device)
            opt.zero_grad()
            emb(idx).pow(2).sum().backward()
            assert emb.weight.grad.layout == torch.sparse_coo
            opt.step()
        return emb.weight.detach()

    assert_same(train("kiln"), train("cpu"))


# ---------------------------------------------------------------- errors

def test_members_on_different_devices_raise():
    for indices, values in (("kiln:0", "kiln:1"), ("kiln:1", "kiln:0"), ("kiln:0", "cpu")):
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            torch.sparse_coo_tensor(torch.tensor([[0, 1]], device=indices),
                                    torch.ones(2, device=values), (3,))


def test_mixed_devices_raise():
    kiln = uncoalesced_coo().to("kiln")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*"
                                           "kiln:0 and cpu"):
        kiln + uncoalesced_coo()
    with pytest.raises(RuntimeError, match="kiln:0 and kiln:1"):
        kiln + uncoalesced_coo().to("kiln:1")
    with pytest.raises(RuntimeError, match="kiln:0 and cpu"):
        torch.mm(kiln, torch.randn(3, 2))


def test_cpu_errors_are_raised_at_the_call():
    kiln = uncoalesced_coo().to("kiln")
    with pytest.raises(RuntimeError) as on_cpu:
        torch.mm(uncoalesced_coo(), torch.randn(4, 2))
    with pytest.raises(RuntimeError) as on_kiln:
        torch.mm(kiln, torch.randn(4, 2, device="kiln"))
    assert str(on_kiln.value) == str(on_cpu.value)
    # check_invariants reads the members: with kiln members too.
    with pytest.raises(RuntimeError, match="size is inconsistent with indices"):
        torch.sparse_coo_tensor(torch.tensor([[5]], device="kiln"),
                                torch.tensor([1.0], device="kiln"), (3,), check_invariants=True)
    torch.kiln.synchronize()  # nothing was left broken on the stream


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=str)
def test_an_op_cpu_lacks_for_the_layout_raises_not_implemented(layout):
    kiln = to_layout(sparse_matrix(), layout).to("kiln")
    with pytest.raises(NotImplementedError, match="not implemented for sparse .* on kiln"):
        torch.linalg.svd(kiln)
