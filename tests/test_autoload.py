"""`import torch` alone makes the kiln device usable (torch.backends entry
point); with TORCH_DEVICE_BACKEND_AUTOLOAD=0, `import torch_kiln` does it."""

from conftest import run_python


def test_import_torch_alone_registers_kiln():
    result = run_python(
        "import torch\n"
        "x = torch.ones(3, device='kiln')\n"
        "print(x.device, torch.kiln.device_count(), torch._C._get_privateuse1_backend_name())\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["kiln:0", "2", "kiln"]


def test_autoload_disabled_then_import_torch_kiln():
    code = (
        "import torch\n"
        "assert torch._C._get_privateuse1_backend_name() == 'privateuseone'\n"
        "assert not hasattr(torch, 'kiln')\n"
        "import torch_kiln\n"
        "print(torch.ones(2, device='kiln').sum().item())\n"
    )
    result = run_python(code, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2.0"


def test_importing_twice_is_harmless():
    result = run_python("import torch, torch_kiln, importlib\nimport torch_kiln\nprint(torch.kiln.is_available())")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_importing_torch_kiln_before_torch():
    result = run_python("import torch_kiln\nimport torch\nprint(torch.ones(2, device='kiln').device)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "kiln:0"
