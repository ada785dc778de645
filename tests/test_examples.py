"""The main job: both training examples run on kiln by changing only the
device, and give CPU's per-step losses (issue acceptance numbers)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(script, tmp_path, device, *args, env=None):
    out = tmp_path / f"{script}-{device}.json"
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", script), "--device", device,
         "--json", str(out), *args],
        capture_output=True, text=True, timeout=1200, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text()), result.stdout


def assert_losses_agree(kiln, cpu, steps):
    # Bit for bit: the README promises CPU's losses, not close ones.
    assert len(kiln["steps"]) == len(cpu["steps"]) == steps
    assert kiln["steps"] == cpu["steps"]


def test_fashion_mnist_first_100_steps_match_cpu(tmp_path):
    kiln, stdout = run_example("train_fashion_mnist.py", tmp_path, "kiln", "--max-steps", "100")
    cpu, _ = run_example("train_fashion_mnist.py", tmp_path, "cpu", "--max-steps", "100")
    assert kiln["device"] == "kiln" and cpu["device"] == "cpu"
    assert_losses_agree(kiln, cpu, 100)
    for key in ("seed", "test_accuracy", "images_per_s", "seconds"):
        assert key in kiln
    assert kiln["images_per_s"] > 0
    # The evaluation on the 10,000 test images after the 100 steps: the
    # same model, so CPU's accuracy; it has learnt (the full epoch's 85 % is
    # test_fashion_mnist_one_epoch_on_kiln_reaches_85_percent, `make test-full`;
    # measured 0.79 after 100 steps).
    assert kiln["test_accuracy"] == cpu["test_accuracy"]
    assert kiln["test_accuracy"] >= 0.70, stdout
    assert "test accuracy" in stdout and "images/s" in stdout


# `make test-full` only (marker `slow`): the whole epoch (938 steps); the
# test above checks the evaluation and the report after 100 steps.
@pytest.mark.slow
def test_fashion_mnist_one_epoch_on_kiln_reaches_85_percent(tmp_path):
    kiln, stdout = run_example("train_fashion_mnist.py", tmp_path, "kiln", "--epochs", "1")
    assert kiln["test_accuracy"] >= 0.85, stdout
    assert "test accuracy" in stdout and "images/s" in stdout


def test_fashion_mnist_missing_data_is_a_clear_error(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_fashion_mnist.py"),
         "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Fashion-MNIST not found" in result.stderr
    assert "train-images-idx3-ubyte.gz" in result.stderr


@pytest.mark.parametrize("script,args,message", [
    ("train_fashion_mnist.py", ["--batch-size", "0"], "must be a positive integer, got 0"),
    ("train_fashion_mnist.py", ["--batch-size", "100000"], "larger than the 60000 training images"),
    ("train_fashion_mnist.py", ["--max-steps", "-3"], "must be a positive integer, got -3"),
    ("train_char_gpt.py", ["--epochs", "0"], "must be a positive integer, got 0"),
    ("train_char_gpt.py", ["--width", "130"], "must be a multiple of --heads 4"),
    ("train_char_gpt.py", ["--block-size", "200000"], "must be below the validation text"),
    ("train_char_gpt.py", ["--kl-attention", "--width", "258", "--heads", "2"],
     "the head size --width / --heads is 129; the kl attention kernels allow at most 128"),
])
def test_examples_reject_bad_flags(script, args, message):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr


@pytest.mark.parametrize("threads,steps", [(2, 20), (1, 10),
                                           pytest.param(2, 100, marks=pytest.mark.slow)])
def test_char_gpt_first_steps_match_cpu(tmp_path, threads, steps):
    # At both intra-op thread counts: the weight-gradient matmuls and
    # layer_norm backward round differently at 1 and 2 threads on CPU
    # (tests/test_intra_op_threads.py), and kiln must follow the count. The
    # losses must be equal at every step, so a rounding difference shows from
    # the first; `make test-full` also runs 100 steps at 2 threads.
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    kiln, _ = run_example("train_char_gpt.py", tmp_path, "kiln", "--max-steps", str(steps),
                          "--sample-length", "20", env=env)
    cpu, _ = run_example("train_char_gpt.py", tmp_path, "cpu", "--max-steps", str(steps),
                         "--sample-length", "20", env=env)
    assert_losses_agree(kiln, cpu, steps)
    assert kiln["val_loss"] == cpu["val_loss"]
    assert kiln["tokens_per_s"] > 0 and "val_loss" in kiln


# `make test-full` only (marker `slow`): the first-steps tests above already
# compare kiln with CPU step by step; this is the demo's full run.
@pytest.mark.slow
@pytest.mark.parametrize("device", ["kiln", "cpu"])
def test_char_gpt_500_steps_validation_loss_below_2_5(tmp_path, device):
    result, stdout = run_example("train_char_gpt.py", tmp_path, device, "--max-steps", "500")
    assert result["val_loss"] < 2.5, stdout
    assert "sample:" in stdout


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_examples_train_under_autocast(tmp_path, amp):
    fm, fm_out = run_example("train_fashion_mnist.py", tmp_path, "kiln", "--max-steps", "60",
                             "--amp", amp)
    assert f"autocast {amp}" in fm_out
    assert sum(fm["steps"][-10:]) / 10 < fm["steps"][0]  # the loss went down
    gpt, gpt_out = run_example("train_char_gpt.py", tmp_path, "kiln", "--max-steps", "30",
                               "--amp", amp, "--sample-length", "0", "--layers", "1",
                               "--width", "64")
    assert f"autocast {amp}" in gpt_out
    assert sum(gpt["steps"][-5:]) / 5 < gpt["steps"][0]


def _relative_gap(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_char_gpt_compiled_matches_eager_and_compiled_cpu(tmp_path):
    # Issue 11's acceptance on a small configuration (make test stays quick;
    # the default size was measured by hand, see docs/compile.md).
    small = ["--max-steps", "20", "--layers", "1", "--width", "64", "--block-size", "32",
             "--sample-length", "0"]
    runs = {}
    for name, device, extra in (("eager", "kiln", []), ("compiled", "kiln", ["--compile"]),
                                ("cpu-compiled", "cpu", ["--compile"])):
        (tmp_path / name).mkdir()
        runs[name], out = run_example("train_char_gpt.py", tmp_path / name, device, *small, *extra)
        assert len(runs[name]["steps"]) == 20
    assert "compiled (inductor)" in out and runs["compiled"]["compile"] == "inductor"
    assert _relative_gap(runs["compiled"]["steps"], runs["eager"]["steps"]) <= 1e-4
    assert _relative_gap(runs["compiled"]["steps"], runs["cpu-compiled"]["steps"]) <= 1e-4


def test_char_gpt_kl_attention_tracks_sdpa(tmp_path):
    # --kl-attention: the kl flash-attention kernels (forward and
    # FlashAttention-2's backward, examples/kernels/kl_attention*.py) instead
    # of SDPA, on a block size (100) that is not a multiple of the kernels'
    # 64-row blocks, so ragged tiles and the causal walk over two blocks run.
    # float32 both ways, but the kernels sum scores, softmax rows and
    # gradient matmuls in another order than ATen's SDPA, so the losses are
    # not bit-identical: rounding differences of about 1e-7 relative per
    # step (measured: at most 3e-7 over 40 steps) that training may grow.
    # 1e-4 is the bound the compiled-vs-eager test above uses for the same
    # kind of difference; a wrong gradient moves the losses past it within
    # the 30 steps (measured: dQ without its 1/sqrt(head_dim) factor gives a
    # gap of 1.3e-4 at step 8, 4.6e-3 at step 21).
    small = ["--max-steps", "30", "--layers", "1", "--width", "64", "--block-size", "100",
             "--batch-size", "8", "--sample-length", "20"]
    env = {**os.environ, "KILN_KERNELS_CACHE_DIR": str(tmp_path / "kernels")}
    runs = {}
    for name, extra in (("sdpa", []), ("kl", ["--kl-attention"])):
        (tmp_path / name).mkdir()
        runs[name], out = run_example("train_char_gpt.py", tmp_path / name, "kiln", *small, *extra,
                                      env=env)
        assert len(runs[name]["steps"]) == 30
    assert "kl attention" in out and runs["kl"]["kl_attention"] is True
    assert runs["sdpa"]["kl_attention"] is False
    assert _relative_gap(runs["kl"]["steps"], runs["sdpa"]["steps"]) <= 1e-4
    assert abs(runs["kl"]["val_loss"] - runs["sdpa"]["val_loss"]) <= 1e-4 * runs["sdpa"]["val_loss"]
    assert sum(runs["kl"]["steps"][-5:]) / 5 < runs["kl"]["steps"][0] / 2  # it trains


def test_fashion_mnist_compiled_with_aot_eager_is_bit_identical(tmp_path):
    (tmp_path / "eager").mkdir()
    (tmp_path / "compiled").mkdir()
    eager, _ = run_example("train_fashion_mnist.py", tmp_path / "eager", "kiln", "--max-steps", "20")
    compiled, _ = run_example("train_fashion_mnist.py", tmp_path / "compiled", "kiln",
                              "--max-steps", "20", "--compile", "aot_eager")
    assert compiled["steps"] == eager["steps"]  # the same kernels, dropout from the same seed
