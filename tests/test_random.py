"""Each kiln device has a default generator seeded like CPU's."""

import pytest
import torch


def test_default_generator_seeding():
    torch.kiln.manual_seed(123)
    assert torch.kiln.initial_seed() == 123
    torch.kiln.manual_seed_all(7)
    assert torch.kiln.initial_seed() == 7
    with torch.kiln.device(1):
        assert torch.kiln.initial_seed() == 7
    torch.manual_seed(99)  # seeds kiln too
    assert torch.kiln.initial_seed() == 99
    torch.kiln.seed()
    assert torch.kiln.initial_seed() != 99
    torch.kiln.seed_all()


def test_rng_state_round_trip_and_cpu_format():
    torch.kiln.manual_seed(5)
    state = torch.kiln.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    cpu = torch.Generator()
    cpu.manual_seed(5)
    assert torch.equal(state, cpu.get_state())
    torch.kiln.manual_seed(6)
    torch.kiln.set_rng_state(state)
    assert torch.equal(torch.kiln.get_rng_state(), state)
    assert len(torch.kiln.get_rng_state_all()) == 2
    torch.kiln.set_rng_state_all(torch.kiln.get_rng_state_all())


def test_generator_objects():
    g = torch.Generator(device="kiln")
    assert g.device == torch.device("kiln:0")
    g.manual_seed(3)
    assert g.initial_seed() == 3
    assert torch.Generator(device="kiln:1").device == torch.device("kiln:1")


def test_generator_reseed_and_state_round_trip():
    g = torch.Generator(device="kiln")
    g.manual_seed(0)
    a = torch.rand(8, generator=g, device="kiln")
    g.manual_seed(0)
    assert torch.equal(torch.rand(8, generator=g, device="kiln").cpu(), a.cpu())
    state = g.get_state()
    b = torch.randn(8, generator=g, device="kiln")
    g.set_state(state)
    assert torch.equal(torch.randn(8, generator=g, device="kiln").cpu(), b.cpu())
    p = torch.randperm(10, generator=g, device="kiln")
    assert sorted(p.tolist()) == list(range(10))
    r = torch.randint(0, 5, (3,), generator=g, device="kiln")
    assert r.device.type == "kiln" and all(0 <= v < 5 for v in r.tolist())


@pytest.mark.parametrize("device", ["kiln:0", "kiln:1"])
def test_generators_deepcopy_and_pickle(device):
    """copy.deepcopy and pickle of a kiln generator raised SystemError
    (PyTorch's reduction asks non-CPU generators for a Philox offset, which
    kiln's, CPU's Mersenne Twister, does not have); CPU generators keep
    PyTorch's reduction (found by a fresh user)."""
    import copy
    import pickle

    g = torch.Generator(device=device).manual_seed(3)
    torch.randn(5, device=device, generator=g)  # a position past the seed
    copies = [copy.deepcopy(g), pickle.loads(pickle.dumps(g))]
    expected = torch.randn(7, device=device, generator=g).cpu()
    for c in copies:
        assert c.device == torch.device(device) and c.initial_seed() == 3
        assert torch.equal(torch.randn(7, device=device, generator=c).cpu(), expected)
    cpu = torch.Generator().manual_seed(4)
    assert torch.equal(copy.deepcopy(cpu).get_state(), cpu.get_state())
    assert torch.equal(pickle.loads(pickle.dumps(cpu)).get_state(), cpu.get_state())


def test_seeding_without_kiln_devices_is_ignored_as_on_cuda():
    from conftest import run_python
    code = ("import torch, torch_kiln\n"
            "torch.kiln.manual_seed(3); torch.kiln.seed(); torch.kiln.manual_seed_all(3)\n"
            "torch.kiln.seed_all(); torch.manual_seed(5)\n"
            "print(torch.kiln.device_count(), torch.initial_seed())\n")
    result = run_python(code, {"KILN_DEVICE_COUNT": "0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "5"]


def test_two_dropouts_after_the_same_seed_are_equal():
    torch.manual_seed(1)
    a = torch.nn.functional.dropout(torch.ones(1000, device="kiln"), 0.5)
    torch.manual_seed(1)
    b = torch.nn.functional.dropout(torch.ones(1000, device="kiln"), 0.5)
    assert torch.equal(a.cpu(), b.cpu())
    assert 350 <= (a == 0).sum().item() <= 650


RANDOM_OPS = {
    "rand": lambda d, g: torch.rand(5, 7, device=d, generator=g),
    "randn": lambda d, g: torch.randn(5, 7, device=d, generator=g),
    "randint": lambda d, g: torch.randint(0, 100, (50,), device=d, generator=g),
    "randperm": lambda d, g: torch.randperm(30, device=d, generator=g),
    "bernoulli": lambda d, g: torch.bernoulli(torch.full((64,), 0.3, device=d), generator=g),
    "bernoulli_p": lambda d, g: torch.empty(64, device=d).bernoulli_(0.7, generator=g),
    "multinomial": lambda d, g: torch.multinomial(torch.tensor([0.1, 0.2, 0.7], device=d), 20,
                                                  replacement=True, generator=g),
    "normal_": lambda d, g: torch.empty(40, device=d).normal_(2.0, 3.0, generator=g),
    "uniform_": lambda d, g: torch.empty(40, device=d).uniform_(-1, 1, generator=g),
    "exponential_": lambda d, g: torch.empty(40, device=d).exponential_(2.0, generator=g),
    "random_": lambda d, g: torch.empty(40, device=d, dtype=torch.int64).random_(0, 9, generator=g),
    "normal_fn": lambda d, g: torch.normal(torch.zeros(9, device=d), torch.ones(9, device=d), generator=g),
}


@pytest.mark.parametrize("name", list(RANDOM_OPS))
def test_random_ops_reproduce_cpu_sequence_for_the_same_seed(name):
    results = []
    for device in ("cpu", "kiln"):
        g = torch.Generator(device=device)
        g.manual_seed(1234)
        results.append(RANDOM_OPS[name](device, g).cpu())
    assert torch.equal(results[0], results[1])


def test_default_generator_random_ops_and_rand_like():
    torch.manual_seed(5)
    k = [torch.rand(4, device="kiln"), torch.randn_like(torch.empty(4, device="kiln")),
         torch.rand_like(torch.empty(3, device="kiln"))]
    torch.manual_seed(5)
    c = [torch.rand(4), torch.randn_like(torch.empty(4)), torch.rand_like(torch.empty(3))]
    for a, b in zip(k, c):
        assert torch.equal(a.cpu(), b)


def test_sequence_follows_launch_order_across_streams():
    g = torch.Generator(device="kiln")
    g.manual_seed(7)
    slow, fast = torch.kiln.Stream(), torch.kiln.Stream()
    with torch.kiln.stream(slow):
        torch.kiln._sleep(100)  # the first random op would run last without ordering
        first = torch.rand(16, device="kiln", generator=g)
    with torch.kiln.stream(fast):
        second = torch.rand(16, device="kiln", generator=g)
    torch.kiln.synchronize()
    cpu = torch.Generator().manual_seed(7)
    assert torch.equal(first.cpu(), torch.rand(16, generator=cpu))
    assert torch.equal(second.cpu(), torch.rand(16, generator=cpu))


def test_state_reads_wait_for_launched_random_ops():
    g = torch.Generator(device="kiln")
    g.manual_seed(3)
    torch.kiln._sleep(100)
    torch.rand(1000, device="kiln", generator=g)
    state = g.get_state()  # after the queued rand, not before
    cpu = torch.Generator().manual_seed(3)
    torch.rand(1000, generator=cpu)
    assert torch.equal(state, cpu.get_state())


def test_fork_rng_restores_kiln_state():
    torch.manual_seed(11)
    with torch.random.fork_rng(device_type="kiln"):
        torch.rand(10, device="kiln")
    after = torch.rand(10, device="kiln")
    torch.manual_seed(11)
    assert torch.equal(after.cpu(), torch.rand(10, device="kiln").cpu())


def test_cpu_generator_with_kiln_tensors_is_rejected():
    with pytest.raises(RuntimeError, match="generator"):
        torch.rand(3, device="kiln", generator=torch.Generator())


def test_default_generators_are_the_devices_default_generators():
    generators = torch.kiln.default_generators
    assert isinstance(generators, tuple) and len(generators) == torch.kiln.device_count()
    from torch.kiln import default_generators
    assert default_generators is generators
    assert "default_generators" in dir(torch.kiln)
    for index, generator in enumerate(generators):
        assert generator.device == torch.device("kiln", index)
        generator.manual_seed(1234 + index)
        drawn = torch.randn(5, device=f"kiln:{index}")  # uses the device's default generator
        torch.kiln.manual_seed_all(0)
        with torch.kiln.device(index):
            torch.kiln.manual_seed(1234 + index)
        assert torch.equal(torch.randn(5, device=f"kiln:{index}").cpu(), drawn.cpu())
        assert generator.initial_seed() == 1234 + index


def test_default_generators_do_not_initialise_kiln_at_import():
    from conftest import run_python
    code = ("import torch\n"
            "print(torch.kiln.is_initialized(), 'default_generators' in dir(torch.kiln))\n"
            "g = torch.kiln.default_generators\n"
            "print(torch.kiln.is_initialized(), len(g))\n")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True", "True", "2"]
