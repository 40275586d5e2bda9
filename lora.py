"""LoRA: train a low-rank change of every linear layer and leave the model's own weights alone.

Report 001 trained Qwen2.5-7B-Instruct this way (LoRA, lr 2e-6). Each linear layer W (out, in)
gains two small matrices, and only they are trained:

    y = W x + (alpha / r) * B (A x)          A (r, in), B (out, r); r << in, out

B starts at zero, so the adapted model's first forward is the base model's exactly: the first
update's ratios are exactly 1 and its KL to the base exactly 0. A starts as nn.Linear's own
weights do (kaiming_uniform, a = sqrt(5)), as peft initialises it.

What LoRA changes in RL:
- The reference for free. W never moves, so the policy RL started from is this same model with
  its adapters switched off (`adapters_off`): no second copy of the weights in memory. TRL's
  GRPOTrainer computes the reference log-probs under peft's `disable_adapter()`; verl: "the
  reference policy will be actor without lora applied".
- The optimizer holds only A and B: AdamW's two moments cost r (in + out) numbers a layer, not
  in * out (`adapter_parameters`).
- The lr and the rank. "LoRA Without Regret" (Thinking Machines, 2025) found the best LoRA lr
  about 10x full fine-tuning's, nearly independent of the rank, and rank 1 matching full
  fine-tuning under policy gradients, with LoRA on every linear layer (attention alone lost):
  an episode teaches the policy about one number (its advantage), so an update has little to
  write, and a low-rank change has room for it. TRL's GRPO docs use r = 1, alpha = 32.
- An export merges: W' = W + (alpha / r) B A is an ordinary linear layer (`merged`), which
  plain transformers loads.

    python train.py --lora-rank 1 --k 8 --norm global --steps 60      # the tiny model, rank 1

The lesson as a test: `python -m pytest -q tests/test_lora.py -m lesson`.
"""
import contextlib
import copy
import math
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Knobs:
    """LoRA: a low-rank change of every linear layer trained, the model's weights frozen."""
    lora_rank: int = field(default=0, metadata={"help": "train LoRA adapters of this rank on every linear layer but "
                           "the LM head, the weights frozen; the reference is the policy without them; 0 = train "
                           "every weight", "min": 0, "max": 4096})
    lora_alpha: float = field(default=32.0, metadata={"help": "the adapters' change is scaled by alpha / rank "
                              "(TRL's GRPO docs: 32)", "min": 1e-6, "max": 1e6, "flag": False})


class LoRALinear(nn.Module):
    """A frozen nn.Linear W and its trained low-rank change: W x + (alpha / r) B A x."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None = None):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.scale = alpha / rank
        a = torch.empty(rank, base.in_features)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)   # as nn.Linear (and peft) initialise
        self.lora_A = nn.Parameter(a.to(base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))
        self.enabled = True                  # adapters_off turns it off: the base layer alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:                          # x (..., in)
        y = self.base(x)                                                          # (..., out)
        if not self.enabled:
            return y
        # y = W x + (alpha / r) B (A x): two thin products, never the (out, in) product B A
        return y + self.scale * (x.to(self.lora_A.dtype) @ self.lora_A.T @ self.lora_B.T).to(y.dtype)

    def delta(self) -> torch.Tensor:
        """(alpha / r) B A, the (out, in) change this adapter makes to W."""
        return self.scale * self.lora_B @ self.lora_A


def add_adapters(model: nn.Module, rank: int, alpha: float, seed: int = 0) -> int:
    """Freeze every weight of model and put a LoRALinear around each of its nn.Linear layers but
    the output head (the LM head, often the input embedding's own matrix); returns how many.
    In place: the model object stays the one the caller holds. The A's are drawn from their own
    generator (seed), so a run's adapters do not depend on what drew random numbers before."""
    generator = torch.Generator().manual_seed(seed)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    model.requires_grad_(False)
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and child is not head]
    for parent, name, child in targets:
        setattr(parent, name, LoRALinear(child, rank, alpha, generator))
    return len(targets)


def adapters(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What the optimizer holds under LoRA: every A and B, nothing else."""
    return [p for m in adapters(model) for p in (m.lora_A, m.lora_B)]


def adapter_state(model: nn.Module) -> dict:
    """Every A and B by its state-dict name: what a checkpoint of a LoRA run must keep besides
    the weights the run started from."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.rsplit(".", 1)[-1] in ("lora_A", "lora_B")}


def load_adapter_state(model: nn.Module, state: dict) -> None:
    """adapter_state's dict back into model; KeyError when they are not the same adapters."""
    if set(state) != set(adapter_state(model)):
        raise KeyError("the checkpoint's adapters are not this model's")
    model.load_state_dict(state, strict=False)


@contextlib.contextmanager
def adapters_off(model: nn.Module | None):
    """The base model inside the block: every adapter skipped, so the model computes what it
    computed before RL (the reference policy). A model without adapters (or None) is left as it is."""
    layers = adapters(model) if model is not None else []
    before = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m, was in zip(layers, before):
            m.enabled = was


def merged(model: nn.Module) -> nn.Module:
    """A copy of model with every adapter folded into its layer, W + (alpha / r) B A, and put
    back as a plain nn.Linear: the architecture (and the state dict's keys) of the base model,
    for save_pretrained and plain transformers. The model itself is untouched."""
    out = copy.deepcopy(model)
    for parent in list(out.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                layer = child.base
                with torch.no_grad():
                    layer.weight += child.delta().to(layer.weight.dtype)
                setattr(parent, name, layer)
    return out
