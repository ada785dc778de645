"""Hugging Face transformers and accelerate on kiln, compared with CPU.

Tiny random-init GPT-2, BERT and Llama models (2 layers, width 64, vocab 128,
built from configs: nothing is downloaded) train and generate on kiln with
CPU's numbers, bit for bit: kiln runs CPU's kernels, and every random number
is seeded on the host. accelerate and transformers choose devices from a
fixed list that does not include kiln; ACCELERATE_TORCH_DEVICE=kiln makes
`Trainer` and `Accelerator` use it. What does not work and the workarounds:
docs/porting.md, "Hugging Face".

scripts/install_deps.sh installs the pinned transformers and accelerate.
"""

import os

import pytest
import torch

from conftest import assert_same

_REASON = "needs transformers and accelerate (scripts/install_deps.sh installs them)"
transformers = pytest.importorskip("transformers", reason=_REASON)
accelerate = pytest.importorskip("accelerate", reason=_REASON)

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

VOCAB, SEQ, BATCH, STEPS = 128, 16, 4, 5


def make_model(kind, dropout=0.1, **overrides):
    """A tiny random-init model; the same weights on every call."""
    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                            bos_token_id=1, eos_token_id=2, resid_pdrop=dropout,
                            embd_pdrop=dropout, attn_pdrop=dropout, **overrides)
        return GPT2LMHeadModel(config)
    if kind == "bert":
        config = BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64,
                            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                            **overrides)
        return BertForMaskedLM(config)
    # Llama has no dropout; SiLU MLP, RMSNorm, rotary embeddings, grouped KV heads.
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
                         max_position_embeddings=64, bos_token_id=1, eos_token_id=2, **overrides)
    return LlamaForCausalLM(config)


def batches(count, seed=1):
    """Token batches with right padding in one row (attention mask 0, label -100)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
        mask[1, SEQ - 5:] = 0
        ids[1, SEQ - 5:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def dataset(rows=BATCH * STEPS):
    """Rows for Trainer: the batches above, one example each."""
    examples = []
    for batch in batches(rows // BATCH, seed=3):
        for i in range(BATCH):
            examples.append({key: value[i] for key, value in batch.items()})
    return examples


@pytest.fixture(autouse=True)
def _fresh_accelerate_state(monkeypatch):
    """accelerate keeps its device in process-wide singletons: start each test
    from none, and leave none behind, so CPU and kiln runs do not leak."""
    for name in ("ACCELERATE_TORCH_DEVICE", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    for name in ("ACCELERATE_TORCH_DEVICE", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU"):
        os.environ.pop(name, None)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def params_of(model):
    return [p.detach().cpu() for p in model.parameters()]


def assert_same_params(kiln_params, cpu_params):
    assert len(kiln_params) == len(cpu_params)
    for k, c in zip(kiln_params, cpu_params):
        assert_same(k, c)


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_training_loop_matches_cpu(kind):
    def train(device):
        model = make_model(kind).to(device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        # Dropout draws from the generator of the model's device; seed it
        # after initialization (which drew from CPU's) so both start alike.
        torch.manual_seed(2)
        losses = []
        for batch in batches(STEPS):
            out = model(**{k: v.to(device) for k, v in batch.items()})
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(out.loss.item())
        return losses, params_of(model)

    kiln_losses, kiln_params = train("kiln")
    cpu_losses, cpu_params = train("cpu")
    assert kiln_losses == cpu_losses
    # The losses alone would miss last-bit differences in the weights (a
    # loss near 4.8 has an ulp of 5e-7); the weights after 5 steps do not.
    assert_same_params(kiln_params, cpu_params)


def run_trainer(kind, device, tmp_path, dropout, **extra):
    """STEPS steps of Trainer; returns (args, logged losses, final weights)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    if device == "kiln":
        os.environ["ACCELERATE_TORCH_DEVICE"] = "kiln"
    model = make_model(kind, dropout=dropout)
    args = TrainingArguments(output_dir=str(tmp_path / device), max_steps=STEPS,
                             per_device_train_batch_size=BATCH, learning_rate=1e-3,
                             logging_steps=1, report_to=[], save_strategy="no", seed=7,
                             disable_tqdm=True, use_cpu=(device == "cpu"), **extra)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset(8))
    trainer.train()
    predictions = trainer.predict(dataset(8)).predictions
    trainer.eval_results = {
        "loss": trainer.evaluate()["eval_loss"],
        "logits": torch.from_numpy(predictions[0] if isinstance(predictions, tuple) else predictions),
    }
    os.environ.pop("ACCELERATE_TORCH_DEVICE", None)
    assert next(model.parameters()).device.type == device
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == STEPS
    return args, trainer, losses, params_of(model)


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_trainer_on_kiln_matches_cpu(kind, tmp_path):
    # Dropout off: Trainer's sampler draws its seed from CPU's default
    # generator, which CPU's dropout then continues from, while kiln's dropout
    # has its own generator (as CUDA's does); the masks differ by design, not
    # by kiln. test_training_loop_matches_cpu covers dropout.
    cpu_args, cpu_trainer, cpu_losses, cpu_params = run_trainer(kind, "cpu", tmp_path, dropout=0.0)
    kiln_args, trainer, kiln_losses, kiln_params = run_trainer(kind, "kiln", tmp_path, dropout=0.0)
    assert cpu_args.device == torch.device("cpu")
    assert kiln_args.device == torch.device("kiln") and trainer.accelerator.device.type == "kiln"
    assert kiln_args.n_gpu == 0  # no torch.nn.DataParallel
    assert kiln_losses == cpu_losses
    assert_same_params(kiln_params, cpu_params)
    # evaluate() and predict() of the trained models.
    assert trainer.eval_results["loss"] == cpu_trainer.eval_results["loss"]
    assert_same(trainer.eval_results["logits"], cpu_trainer.eval_results["logits"])


def test_gradient_checkpointing_matches_cpu():
    # Recomputing a checkpointed segment must replay its dropout masks:
    # torch.utils.checkpoint saves and restores kiln's generator state.
    def step(device):
        model = make_model("gpt2").to(device).train()
        # transformers 5 renamed gradient_checkpointing_enable.
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
        assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
        torch.manual_seed(2)
        out = model(**{k: v.to(device) for k, v in batches(1)[0].items()})
        out.loss.backward()
        return out.loss.item(), [p.grad.cpu() for p in model.parameters()]

    kiln_loss, kiln_grads = step("kiln")
    cpu_loss, cpu_grads = step("cpu")
    assert kiln_loss == cpu_loss
    assert_same_params(kiln_grads, cpu_grads)


def test_trainer_mixed_precision_on_kiln(tmp_path, monkeypatch):
    # bf16=True asks transformers whether a *GPU* supports bf16 from a fixed
    # list of device modules, and refuses kiln.
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "kiln")
    with pytest.raises(ValueError, match="bf16/gpu"):
        TrainingArguments(output_dir=str(tmp_path), bf16=True, report_to=[])
    # fp16 passes TrainingArguments, but accelerate accepts fp16 only on its
    # own list of device types.
    args = TrainingArguments(output_dir=str(tmp_path), fp16=True, report_to=[], max_steps=1)
    with pytest.raises(ValueError, match="fp16 mixed precision requires a device in .*kiln"):
        Trainer(model=make_model("llama"), args=args, train_dataset=dataset())
    monkeypatch.delenv("ACCELERATE_TORCH_DEVICE")

    # The workaround for bf16: ACCELERATE_MIXED_PRECISION=bf16 sets the mixed
    # precision without TrainingArguments' check; accelerate then runs the
    # forward under torch.autocast("kiln", torch.bfloat16). Same numbers as
    # bf16=True on CPU: for these ops CPU's autocast lists and CUDA's (which
    # kiln uses) agree.
    _, cpu_trainer, cpu_losses, cpu_params = run_trainer("llama", "cpu", tmp_path, dropout=0.0,
                                                         bf16=True)
    assert cpu_trainer.accelerator.mixed_precision == "bf16"
    _, _, fp32_losses, _ = run_trainer("llama", "cpu", tmp_path, dropout=0.0)
    assert fp32_losses != cpu_losses  # bf16 did change the numbers
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    _, trainer, kiln_losses, kiln_params = run_trainer("llama", "kiln", tmp_path, dropout=0.0)
    assert trainer.accelerator.mixed_precision == "bf16" and trainer.accelerator.native_amp
    seen = []
    model = trainer.model
    hook = model.model.layers[0].mlp.gate_proj.register_forward_hook(
        lambda module, inputs, output: seen.append(output.dtype))
    with trainer.accelerator.autocast():
        model(**{k: v.to("kiln") for k, v in batches(1)[0].items()})
    hook.remove()
    assert seen == [torch.bfloat16]
    assert kiln_losses == cpu_losses
    assert_same_params(kiln_params, cpu_params)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_generate_matches_cpu(kind):
    prompts = torch.tensor([[0, 0, 5, 9, 3, 17], [1, 44, 8, 90, 61, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # left padding

    def generate(device):
        # Untied output embeddings: a random-init GPT-2 with tied ones just
        # repeats the last prompt token.
        model = make_model(kind, tie_word_embeddings=False).to(device).eval()
        torch.kiln.clear_op_tracking()
        out = model.generate(input_ids=prompts.to(device), attention_mask=mask.to(device),
                             max_new_tokens=8, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
        return out.sequences.cpu(), [s.cpu() for s in out.scores], torch.kiln.get_sync_ops()

    kiln_tokens, kiln_scores, syncs = generate("kiln")
    cpu_tokens, cpu_scores, _ = generate("cpu")
    assert kiln_tokens.shape == (2, 6 + 8)
    assert len(set(kiln_tokens[:, 6:].flatten().tolist())) > 2  # not one repeated token
    assert_same(kiln_tokens, cpu_tokens)
    assert len(kiln_scores) == len(cpu_scores) == 8
    for k, c in zip(kiln_scores, cpu_scores):
        assert_same(k, c)
    # generate() reads scalars (stopping criteria) and tensors back on the
    # host, as on CUDA; kiln adds only its first-call layout checks.
    assert syncs.get("aten::_local_scalar_dense", 0) > 0
    unexpected = {op for op in syncs
                  if op not in ("aten::_local_scalar_dense", "aten::_copy_from")
                  and not op.endswith("(layout check)")}
    assert not unexpected, syncs


def test_sampled_generate_matches_cpu_with_the_same_seed():
    # kiln's generator is CPU's Mersenne Twister: top-k/top-p sampling draws
    # CPU's tokens from the same seed.
    def sample(device):
        model = make_model("llama").to(device).eval()
        torch.manual_seed(5)
        return model.generate(input_ids=torch.tensor([[1, 5, 9, 3]], device=device),
                              max_new_tokens=8, do_sample=True, top_k=20, top_p=0.9,
                              temperature=0.8, pad_token_id=0).cpu()

    kiln_tokens, cpu_tokens = sample("kiln"), sample("cpu")
    assert kiln_tokens.shape == (1, 12)
    assert_same(kiln_tokens, cpu_tokens)


def test_from_pretrained_device_map(tmp_path):
    make_model("llama").save_pretrained(tmp_path / "llama")
    ids = batches(1)[0]["input_ids"]
    cpu_model = AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    expected = cpu_model(input_ids=ids).logits.detach()
    for device_map, device in (("kiln", "kiln:0"), ("kiln:1", "kiln:1"), ({"": "kiln:1"}, "kiln:1")):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", device_map=device_map)
        assert {str(p.device) for p in model.parameters()} == {device}, device_map
        assert_same(model(input_ids=ids.to(device)).logits.detach(), expected)
    # "auto" fills accelerate's known devices, not kiln: it lands on CPU.
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", device_map="auto")
    assert {p.device.type for p in auto.parameters()} == {"cpu"}


def test_accelerator_prepare_uses_kiln(monkeypatch):
    def train(device):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        if device == "kiln":
            monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "kiln")
        accelerator = Accelerator(cpu=(device == "cpu"))
        assert accelerator.device.type == device
        model = make_model("llama")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        losses = []
        for batch in loader:
            assert batch["input_ids"].device.type == device
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        monkeypatch.delenv("ACCELERATE_TORCH_DEVICE", raising=False)
        return losses, params_of(model)

    kiln_losses, kiln_params = train("kiln")
    cpu_losses, cpu_params = train("cpu")
    assert len(kiln_losses) == STEPS
    assert kiln_losses == cpu_losses
    assert_same_params(kiln_params, cpu_params)


class KilnRngTrainer(Trainer):
    """Trainer that also checkpoints kiln's generator (docs/porting.md): its
    _save_rng_state/_load_rng_state know CPU, CUDA, XPU, NPU, ... but not
    kiln, so dropout after a resume would not continue the interrupted run."""

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        torch.save(torch.kiln.get_rng_state(), os.path.join(output_dir, "rng_state_kiln.pth"))

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        path = os.path.join(checkpoint or "", "rng_state_kiln.pth")
        if checkpoint is not None and os.path.isfile(path):
            torch.kiln.set_rng_state(torch.load(path, weights_only=True))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_trainer_resumes_from_a_checkpoint_on_kiln(kind, tmp_path):
    def train(device, trainer_class, resume):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        if device == "kiln":
            os.environ["ACCELERATE_TORCH_DEVICE"] = "kiln"
        args = TrainingArguments(output_dir=str(tmp_path / device), max_steps=4,
                                 per_device_train_batch_size=BATCH, save_strategy="steps",
                                 save_steps=2, report_to=[], disable_tqdm=True, seed=7,
                                 use_cpu=(device == "cpu"))
        trainer = trainer_class(model=make_model(kind), args=args, train_dataset=dataset())
        trainer.train(resume_from_checkpoint=str(tmp_path / device / "checkpoint-2") if resume
                      else None)
        os.environ.pop("ACCELERATE_TORCH_DEVICE", None)
        assert next(trainer.model.parameters()).device.type == device
        return params_of(trainer.model)

    # Weights and optimizer state go through safetensors/torch.save from kiln
    # and back; resuming at step 2 gives the uninterrupted run's weights, on
    # kiln as on CPU. With dropout (GPT-2) that needs kiln's generator in the
    # checkpoint too.
    trainer_class = KilnRngTrainer if kind == "gpt2" else Trainer
    cpu_full, cpu_resumed = train("cpu", Trainer, False), train("cpu", Trainer, True)
    kiln_full, kiln_resumed = train("kiln", trainer_class, False), train("kiln", trainer_class, True)
    assert_same_params(cpu_resumed, cpu_full)
    assert_same_params(kiln_resumed, kiln_full)
    if kind == "llama":  # no dropout: kiln and CPU are the same run
        assert_same_params(kiln_full, cpu_full)
    else:
        # Without the kiln generator in the checkpoint, resuming changes the run.
        plain_resumed = train("kiln", Trainer, True)
        assert any(not torch.equal(a, b) for a, b in zip(plain_resumed, kiln_full))
