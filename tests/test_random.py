"""Each kiln device has a default generator seeded like CPU's."""

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
