"""LoRA (lora.py): the adapters start at zero, train alone, and switched off give back the model
RL started from, bit for bit: the reference for free."""
import copy

import pytest
import torch
from torch import nn

import lora
from conftest import tiny_model

IDS = torch.tensor([[3, 7, 2, 9, 4, 11], [5, 5, 8, 2, 13, 6]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def trained(rank: int = 2, steps: int = 3):
    """A tiny model, an untouched copy of it, and the model after `steps` AdamW steps on its
    adapters alone (pushing up the log-probability of IDS's tokens)."""
    model = tiny_model()
    base = copy.deepcopy(model)
    lora.add_adapters(model, rank, alpha=32)
    opt = torch.optim.AdamW(lora.adapter_parameters(model), lr=1e-2)
    for _ in range(steps):
        out = model(IDS, labels=IDS)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return model, base


@pytest.mark.lesson
def test_the_reference_is_the_policy_with_its_adapters_off_bit_for_bit():
    """After three updates the adapted policy has moved, and with its adapters off it computes
    exactly what an untouched copy computes: under LoRA the reference model costs no memory."""
    model, base = trained()
    assert not torch.allclose(logits(model), logits(base), atol=1e-3), "the adapters did not move the policy"
    with lora.adapters_off(model):
        assert torch.equal(logits(model), logits(base)), "the base with its adapters off is not the untouched copy"
    assert not torch.allclose(logits(model), logits(base), atol=1e-3), "adapters_off did not restore the adapters"


def test_the_adapters_start_at_zero_so_the_first_forward_is_the_base_models_exactly():
    model = tiny_model()
    base = logits(model)
    n = lora.add_adapters(model, 4, alpha=32)
    assert n == 7                            # q, k, v, o, gate, up, down of the one layer; not the tied head
    assert torch.equal(logits(model), base)
    assert all(torch.count_nonzero(m.lora_B) == 0 for m in lora.adapters(model))


def test_a_lora_layer_computes_what_peft_computes():
    """peft's Linear.forward: result = base_layer(x) + lora_B(lora_A(dropout(x))) * scaling, with
    lora_A = nn.Linear(in, r, bias=False), lora_B = nn.Linear(r, out, bias=False) and scaling =
    alpha / r; re-implemented here with B made non-zero."""
    torch.manual_seed(0)
    base = nn.Linear(12, 5)
    layer = lora.LoRALinear(copy.deepcopy(base), rank=3, alpha=16)
    with torch.no_grad():
        layer.lora_B.normal_()
    a, b = nn.Linear(12, 3, bias=False), nn.Linear(3, 5, bias=False)
    a.weight.data, b.weight.data = layer.lora_A.data.clone(), layer.lora_B.data.clone()
    x = torch.randn(4, 7, 12)
    assert torch.allclose(layer(x), base(x) + b(a(x)) * (16 / 3), atol=1e-6)
    assert torch.allclose(layer.delta(), b.weight @ a.weight * (16 / 3))


def test_gradients_reach_only_the_adapters_and_they_are_r_times_in_plus_out_a_layer():
    model = tiny_model()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not model.get_output_embeddings()]
    lora.add_adapters(model, 2, alpha=32)
    model(IDS, labels=IDS).loss.backward()
    adapted = {id(p) for p in lora.adapter_parameters(model)}
    assert all(p.grad is None and not p.requires_grad for p in model.parameters() if id(p) not in adapted)
    assert all(m.lora_B.grad.abs().sum() > 0 for m in lora.adapters(model))   # A's is 0 while B is 0
    assert sum(p.numel() for p in lora.adapter_parameters(model)) == sum(2 * (m.in_features + m.out_features)
                                                                          for m in linears)


def test_merged_is_an_ordinary_model_that_computes_what_the_adapted_one_does():
    """W + (alpha / r) B A folded into each layer: the base model's keys and shapes, the adapted
    model's logits (to float32 rounding), and the adapted model left as it was."""
    model, base = trained()
    before = logits(model)
    plain = lora.merged(model)
    assert not lora.adapters(plain) and lora.adapters(model)
    assert {k: v.shape for k, v in plain.state_dict().items()} == {k: v.shape for k, v in base.state_dict().items()}
    assert torch.allclose(logits(plain), before, atol=1e-5)
    assert torch.equal(logits(model), before)


# ---- train.py --lora-rank ----

def metrics(run) -> list:
    import json
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def test_a_lora_run_starts_at_kl_0_trains_only_adapters_and_its_checkpoint_loads_in_plain_transformers(tmp_path):
    """--lora-rank 2 --beta 0.04: the first step's KL to the reference is exactly 0 (B = 0: the
    policy is the reference), later ones are not (the adapters moved, the reference did not);
    the optimizer holds the adapters alone (two tensors for each of the 7 linear layers); the
    checkpoint's weights are the merged policy, an ordinary folder (the tiny Qwen2 written as the
    Llama it equals: policy.export), and its adapters applied to the warm start give the same logits."""
    import train
    from running import config
    from transformers import AutoModelForCausalLM
    from conftest import quick
    cfg = config.parse_config(quick(tmp_path, "lora", "--lora-rank", "2", "--beta", "0.04", "--lr", "1e-2",
                                    "--entropy-coef", "0.01", "--steps", "3", "--save-every", "3"))
    train.train(cfg)
    kl = [r["kl"] for r in metrics(tmp_path / "lora")[1:]]
    assert kl[0] == 0.0 and all(k > 0 for k in kl[1:]), kl
    ckpt = tmp_path / "lora" / "checkpoints" / "step-000003"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert len(state["optimizer"]["param_groups"][0]["params"]) == 2 * 7 == len(state["adapters"])
    plain = AutoModelForCausalLM.from_pretrained(ckpt)
    assert not lora.adapters(plain)
    import tasks
    from models import policy
    base, _ = policy.load(cfg, tasks.TASKS[cfg.task], "cpu", log=lambda s: None)    # the warm start, as the run loaded it
    lora.add_adapters(base, 2, 32)
    lora.load_adapter_state(base, state["adapters"])
    ids = torch.tensor([[3, 7, 2, 9]])
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, base(ids).logits, atol=1e-5)


def test_a_lora_run_resumed_equals_one_that_was_not_interrupted(tmp_path):
    """Its checkpoint keeps the adapters (the weights never moved; load() gives them back): a run
    stopped after 3 steps and resumed to 6 writes the metrics of one run through 6."""
    import train
    from running import config
    from conftest import quick, WARM_STARTS
    argv = ["--lora-rank", "2", "--beta", "0.04", "--lr", "1e-2", "--entropy-coef", "0.01"]   # the bonus: a gradient
                                                                                 # even where every reward is 0
    train.train(config.parse_config(quick(tmp_path, "whole", "--steps", "6", *argv)))
    train.train(config.parse_config(quick(tmp_path, "cut", "--steps", "3", "--save-every", "3", *argv)))
    train.train(config.parse_config(["--resume", str(tmp_path / "cut"), "--steps", "6"]))
    whole, cut = metrics(tmp_path / "whole")[1:], metrics(tmp_path / "cut")[1:]
    assert [r["step"] for r in cut] == [1, 2, 3, 4, 5, 6]
    assert len({r["kl"] for r in whole}) > 2, "the adapters did not move: nothing to compare"
    for key in ("reward_mean", "loss", "kl", "grad_norm", "entropy"):
        assert [r[key] for r in cut] == pytest.approx([r[key] for r in whole], rel=1e-5), key


def test_a_model_without_linear_layers_is_refused_in_one_line(tmp_path):
    """GPT-2's layers are Conv1D, not nn.Linear: --lora-rank would freeze every weight and train
    nothing (AdamW: "an empty parameter list"). train.py names the cause instead."""
    import train
    from models import pretrained
    from running import config
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(pretrained.ModelError, match="no nn.Linear layer to adapt"):
        train.reference_and_optimizer(config.parse_config(["--lora-rank", "1", "--out", str(tmp_path / "run")]), gpt2, None)
    assert not lora.adapters(tiny_model()) and lora.add_adapters(tiny_model(), 1, 32) == 7


def test_with_adapters_the_shared_prefix_and_fast_change_how_a_step_is_computed_not_what(tmp_path):
    """The shared-prompt forward (shared_prefix.py) and --fast (the old log-probs taken from the
    update's own forward, micro-batches sorted by length) are the plain path's arithmetic in
    another order: with adapters, 4 steps shared write the plain run's metrics, and --fast's
    first step is the plain one's."""
    import dataclasses
    import train
    from running import config
    from conftest import quick
    argv = ["--lora-rank", "2", "--beta", "0.04", "--lr", "1e-2", "--entropy-coef", "0.01", "--micro-batch", "4",
            "--steps", "4", "--eval-every", "4", "--device", "cpu"]
    train.train(dataclasses.replace(config.parse_config(quick(tmp_path, "plain", *argv)), no_shared_prefix=True))
    train.train(config.parse_config(quick(tmp_path, "shared", *argv)))
    train.train(config.parse_config(quick(tmp_path, "fast", *argv, "--fast")))
    plain, shared, fast = (metrics(tmp_path / name)[1:] for name in ("plain", "shared", "fast"))
    assert len({r["kl"] for r in plain}) > 2, "the adapters did not move: nothing to compare"
    for key in ("reward_mean", "loss", "kl", "grad_norm", "entropy"):
        assert [r[key] for r in shared] == pytest.approx([r[key] for r in plain], rel=1e-4, abs=1e-6), key
        assert fast[0][key] == pytest.approx(plain[0][key], rel=1e-4, abs=1e-6), key


def test_init_from_a_lora_run_starts_from_its_merged_weights(tmp_path):
    """A second stage --init-from a LoRA run's checkpoint starts from the merged policy (its
    folder holds W + (alpha / r) B A): with fresh adapters (B = 0) its first rollouts are a
    full fine-tuning run's from the same checkpoint, and not those of a run from the warm start."""
    import train
    from running import config
    from conftest import quick
    train.train(config.parse_config(quick(tmp_path, "stage1", "--lora-rank", "2", "--lr", "3e-2", "--entropy-coef",
                                          "0.01", "--steps", "4", "--save-every", "4")))
    stage1 = str(tmp_path / "stage1")
    runs = {"lora": ["--init-from", stage1, "--lora-rank", "2"], "full": ["--init-from", stage1], "warm": []}
    for name, argv in runs.items():
        train.train(config.parse_config(quick(tmp_path, name, *argv, "--steps", "1", "--entropy-coef", "0.01")))
    first = {name: metrics(tmp_path / name)[1] for name in runs}        # step 1, as sampled
    for key in ("reward_mean", "entropy", "completions/mean_length"):
        assert first["lora"][key] == pytest.approx(first["full"][key], rel=1e-6), key
    assert first["lora"]["entropy"] != pytest.approx(first["warm"]["entropy"], rel=1e-3)
