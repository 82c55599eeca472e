"""hideseek.optim.hf.SAMTrainer: a few Trainer steps equal SAM steps taken by hand."""
import pytest
import torch
import torch.nn.functional as F

import hideseek as hs

transformers = pytest.importorskip("transformers")
from hideseek.optim.hf import SAMTrainer  # noqa: E402


def _bert(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg).double()


class _Rows(torch.utils.data.Dataset):
    def __init__(self, ids, labels):
        self.ids, self.labels = ids, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


@pytest.mark.parametrize("measure", ["euclidean", "geodesic_mixed"])
def test_sam_trainer_steps_equal_sam_by_hand(tmp_path, measure):
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 40, (8, 6), generator=g), torch.randint(0, 3, (8,), generator=g)
    model, ref = _bert(), _bert()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=3, learning_rate=0.1,
        lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], save_strategy="no", use_cpu=True,
        logging_strategy="no", seed=0, disable_tqdm=True)
    trainer = SAMTrainer(model=model, args=args, train_dataset=_Rows(ids, labels),
                         optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
                         sam_measure=measure, sam_rho=0.05)
    trainer.train()
    assert trainer.sam.measure == hs.Measure.parse(measure)
    sam = hs.optim.SAM(ref, torch.optim.SGD(ref.parameters(), lr=0.1), measure, rho=0.05)
    ref.train()
    for _ in range(3):       # one batch of all 8 rows per step; the mean loss ignores their order
        F.cross_entropy(ref(input_ids=ids).logits, labels).backward()
        sam.first_step(zero_grad=True)
        F.cross_entropy(ref(input_ids=ids).logits, labels).backward()
        sam.second_step(zero_grad=True)
    moved = 0.0
    for (n, p), q, p0 in zip(model.named_parameters(), ref.parameters(), _bert().parameters()):
        assert torch.allclose(p.detach(), q.detach(), rtol=0, atol=1e-10), n
        moved = max(moved, float((p - p0).detach().abs().max()))
    assert moved > 1e-3


class _InOrder(SAMTrainer):
    """Micro-batches in dataset order (the test's reference needs to know them)."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def test_sam_trainer_with_gradient_accumulation_ascends_per_micro_batch(tmp_path):
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 40, (8, 6), generator=g), torch.randint(0, 3, (8,), generator=g)
    model, ref = _bert(), _bert()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1,
        learning_rate=0.1, lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], save_strategy="no",
        use_cpu=True, logging_strategy="no", seed=0, disable_tqdm=True)
    # the loss over the whole accumulated batch, summed per micro-batch: mean over the 8 rows
    def loss_func(outputs, labels, num_items_in_batch=None):
        return F.cross_entropy(outputs.logits, labels, reduction="sum") / num_items_in_batch

    _InOrder(model=model, args=args, train_dataset=_Rows(ids, labels), compute_loss_func=loss_func,
             optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
             sam_measure="geodesic_invariant", sam_rho=0.05).train()
    sam = hs.optim.SAM(ref, torch.optim.SGD(ref.parameters(), lr=0.1), "geodesic_invariant", rho=0.05)
    ref.train()
    total = [torch.zeros_like(p) for p in ref.parameters()]
    for mb in (slice(0, 4), slice(4, 8)):
        F.cross_entropy(ref(input_ids=ids[mb]).logits, labels[mb]).backward()
        sam.first_step(zero_grad=True)
        (F.cross_entropy(ref(input_ids=ids[mb]).logits, labels[mb]) / 2).backward()
        sam.restore()
        for t, p in zip(total, ref.parameters()):
            t += p.grad
        sam.zero_grad()
    for t, p in zip(total, ref.parameters()):
        p.grad = t
    sam.base_optimizer.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.detach(), q.detach(), rtol=0, atol=1e-10), n
