"""The warm start's loss without the vocabulary-wide logits (warm_start.py, sft_loss_sum):
the same loss and gradient as `model(labels=...)`, in micro-batches or not."""
import pytest
import torch
from transformers import Qwen2ForCausalLM

from conftest import tiny_model
from models import policy
from tasks import tool_task
import warm_start


@pytest.mark.lesson
def test_the_lean_loss_equals_transformers_own_and_micro_batches_add_up():
    model = tiny_model(2)
    ids = torch.randint(2, 20, (4, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:], mask[3, 4:] = 0, 0                                  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100                                             # the prompt: not trained
    labels[2, 5:7] = -100                                            # an environment's reply
    reference = model(input_ids=ids, attention_mask=mask, labels=labels).loss   # HF: token mean
    reference.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    tokens = (labels[:, 1:] != -100).sum()
    total = 0.0
    for i in (0, 2):                                                 # two micro-batches of 2
        part = warm_start.sft_loss_sum(model, ids[i:i + 2], mask[i:i + 2], labels[i:i + 2]) / tokens
        part.backward()
        total += part.item()
    assert abs(total - reference.item()) < 1e-5 * reference.item()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-7)


def test_a_warm_start_in_micro_batches_takes_the_whole_batchs_steps():
    tok = policy.build_tokenizer(tool_task.vocabulary())
    losses = {}
    for micro in (0, 3):                      # transformers' loss on all 8, ours on 3 + 3 + 2
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(policy.tiny_config(tok, 16, 1, tool_task.MAX_POSITIONS))
        losses[micro] = warm_start.fit(tool_task, model, tok, warm_start.WarmStart(4, 3e-3, 8, micro_batch=micro))
    assert losses[0] == pytest.approx(losses[3], rel=1e-5)


def test_overtrained_is_report_003s_rising_held_out_loss_with_a_training_loss_that_does_not_rise():
    """The held-out answer NLL ends >= 10% above its lowest evaluation (step 2's 1.0 here) while
    the training answer NLL ends no higher than at that evaluation: hand-made rows, each side of
    each line."""
    def rows(end_eval, end_train):
        return [{"step": 0, "eval_answer_nll": 1.5, "train_answer_nll": 1.6}, {"step": 1, "loss": 0.3},
                {"step": 2, "eval_answer_nll": 1.0, "train_answer_nll": 0.9},
                {"step": 3, "eval_answer_nll": end_eval, "train_answer_nll": end_train}]
    assert warm_start.overtrained(rows(1.1, 0.9))            # exactly 10% above, training loss held
    assert warm_start.overtrained(rows(1.3, 0.5))
    assert not warm_start.overtrained(rows(1.09, 0.5))       # under 10% above
    assert not warm_start.overtrained(rows(1.3, 0.91))       # the training loss rose too
    assert not warm_start.overtrained(rows(0.8, 0.5))        # the end is the lowest
