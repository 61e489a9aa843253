"""The HF Trainer on gradsync: ``gradsync.install()`` before ``Trainer(...)``, checked against torch's DDP.

The Trainer wraps the model through Accelerate's ``prepare``, which calls
``torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)``; installed,
that builds gradsync's. Each scenario trains a 2-layer GPT-2 on random token ids for 4 optimizer
steps, twice in the same two gloo workers (torch's DDP, then gradsync's), and the test process
checks:

- the wrapper the Trainer built is gradsync's, and ``unwrap_model`` sees through it
  (``_get_name()`` is ``GPT2LMHeadModel``: issue #12, where it was ``DistributedDataParallel``, the
  label smoother did not shift the labels and silently trained on another loss);
- replicas are bitwise equal across ranks; gradsync's losses, first-step gradients and final
  weights are bitwise torch DDP's;
- the first averaged gradient matches a hand reference (both ranks' batches, computed in one
  process, clipped to ``max_grad_norm``), while each rank's own gradient is far from it: so the
  checks would catch a run that never averages. With label smoothing the first loss is the
  shifted one and far from the unshifted loss of the issue.

One isolated pair of workers: TrainingArguments resets Accelerate's process-wide state and the
test sets RANK/WORLD_SIZE as torchrun would, none of which may leak into the shared pool.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed
from integration_support import assert_built_by, assert_equal, gradsync_installed, max_diff, run_each, scenario_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SEQ = 16
VOCAB = 64
BATCH = 2  # per device
STEPS = 4  # optimizer steps
RUN_TIMEOUT_S = 150

SCENARIOS = {
    "plain": {},
    "label_smoothing": {"label_smoothing_factor": 0.1},
    "gradient_accumulation": {"gradient_accumulation_steps": 2},
}


# ---------------------------------------------------------------------------------- in the workers


def _labels(ids: torch.Tensor) -> torch.Tensor:
    """The ids, but position 0 ignored (-100): it is never a target once shifted anyway.

    So the Trainer's token count for the loss (``num_items_in_batch``, counted on the unshifted
    labels for a config without ``loss_type``) is the true one, and its loss is the plain mean
    over target tokens that the hand reference computes.
    """
    labels = ids.clone()
    labels[..., 0] = -100
    return labels


class RandomIds(torch.utils.data.Dataset):
    """Fixed random token ids; the model (or the label smoother) shifts the labels."""

    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": _labels(self.ids[i])}


def _model() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _trainer_class() -> type:
    from transformers import Trainer, TrainerCallback

    class FirstGrads(TrainerCallback):
        """The gradients of the first optimizer step, as the optimizer sees them (averaged, clipped)."""

        def __init__(self) -> None:
            self.grads: dict[str, torch.Tensor] = {}

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if state.global_step == 0:
                self.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    class RecordingTrainer(Trainer):
        """Records every micro-batch and the loss computed on it."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.first_grads = FirstGrads()
            super().__init__(*args, callbacks=[self.first_grads], **kwargs)
            self.seen: list[torch.Tensor] = []
            self.losses: list[torch.Tensor] = []

        def compute_loss(self, model: Any, inputs: dict, *args: Any, **kwargs: Any) -> Any:
            self.seen.append(inputs["input_ids"].clone())
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            self.losses.append(loss.detach().clone())
            return loss

    return RecordingTrainer


def _run(overrides: dict, use_gradsync: bool, out_dir: str) -> dict[str, Any]:
    from accelerate.state import GradientState
    from transformers import GPT2LMHeadModel, TrainingArguments

    GradientState._reset_state()  # TrainingArguments resets the rest of Accelerate's state itself
    with gradsync_installed() if use_gradsync else nullcontext():
        args = TrainingArguments(
            output_dir=out_dir,
            use_cpu=True,
            max_steps=STEPS,
            per_device_train_batch_size=BATCH,
            learning_rate=1e-3,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            ddp_backend="gloo",
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=1,
            **overrides,
        )
        model = _model()
        init = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = _trainer_class()(model=model, args=args, train_dataset=RandomIds(64))
        trainer.train()
        wrapped = trainer.model_wrapped
        result = {
            "type": f"{type(wrapped).__module__}.{type(wrapped).__qualname__}",
            "unwrapped_name": trainer.accelerator.unwrap_model(wrapped)._get_name(),
            "init": init,
            "seen": trainer.seen,
            "losses": trainer.losses,
            "first_grads": trainer.first_grads.grads,
            "weights": {k: v.clone() for k, v in model.state_dict().items()},
        }
        trainer.save_model(out_dir)  # the main process writes
        dist.barrier()
        result["reloaded"] = GPT2LMHeadModel.from_pretrained(out_dir).state_dict()
    return result


def _hand_first_grads(init: dict, micro: list[torch.Tensor], epsilon: float) -> dict[str, torch.Tensor]:
    """The gradient of the mean (label-smoothed) loss over ``micro``, shifted labels, no DDP."""
    from transformers.trainer_pt_utils import LabelSmoother

    model = _model()
    model.load_state_dict(init)
    smoother = LabelSmoother(epsilon=epsilon)
    for ids in micro:
        (smoother(model(input_ids=ids), _labels(ids), shift_labels=True) / len(micro)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _scenario(name: str, out_root: str) -> dict[str, Any]:
    overrides = SCENARIOS[name]
    out: dict[str, Any] = {}
    for run, use_gradsync in (("torch", False), ("gradsync", True)):
        out[run] = _run(overrides, use_gradsync, os.path.join(out_root, f"{name}-{run}"))
    accumulation = overrides.get("gradient_accumulation_steps", 1)
    epsilon = overrides.get("label_smoothing_factor", 0.0)
    own_first = out["torch"]["seen"][:accumulation]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, own_first)
    init = out["torch"]["init"]
    out["local_first_grads"] = _hand_first_grads(init, own_first, epsilon)  # the negative control
    out["hand_first_grads"] = _hand_first_grads(init, sum(everyone, []), epsilon)
    if epsilon:  # the first loss as the issue computed it (labels not shifted) and as it should be
        from transformers.trainer_pt_utils import LabelSmoother

        model = _model()
        model.load_state_dict(init)
        with torch.no_grad():
            logits, labels = model(input_ids=own_first[0]), _labels(own_first[0])
            out["loss_shifted"] = LabelSmoother(epsilon)(logits, labels, shift_labels=True)
            out["loss_unshifted"] = LabelSmoother(epsilon)(logits, labels, shift_labels=False)
    return out


def _all_scenarios(out_root: str) -> dict[str, Any]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # config and loading chatter, once per rank and run
    hf_logging.disable_progress_bar()
    return run_each(SCENARIOS, _scenario, out_root)


# ---------------------------------------------------------------------------------- in pytest
@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_root = str(tmp_path_factory.mktemp("hf_trainer"))
    return run_distributed(_all_scenarios, 2, out_root, timeout_s=RUN_TIMEOUT_S, isolated=True, pg_timeout_s=30)


def _clipped(grads: dict[str, torch.Tensor], max_norm: float = 1.0) -> dict[str, torch.Tensor]:
    """What the Trainer's clip_grad_norm_ (max_grad_norm=1.0) makes of ``grads``."""
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_'s formula
    return {k: g * coef for k, g in grads.items()}


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_hf_trainer_matches_torch_ddp(results: list[dict[str, Any]], name: str) -> None:
    r0, r1 = ranks = scenario_ranks(results, name)
    ours, theirs = r0["gradsync"], r0["torch"]
    assert_built_by(ours, theirs)
    for run in ("torch", "gradsync"):
        assert r0[run]["unwrapped_name"] == "GPT2LMHeadModel", r0[run]["unwrapped_name"]
        assert_equal(r0[run]["weights"], r1[run]["weights"], f"{run}: rank 0 vs rank 1 weights")
        assert_equal(r0[run]["first_grads"], r1[run]["first_grads"], f"{run}: rank 0 vs rank 1 first gradients")
        assert_equal(r0[run]["reloaded"], r0[run]["weights"], f"{run}: save_model reloaded with from_pretrained")
    for r in ranks:
        assert all(torch.equal(a, b) for a, b in zip(r["gradsync"]["seen"], r["torch"]["seen"])), "other batches"
        assert torch.equal(torch.stack(r["gradsync"]["losses"]), torch.stack(r["torch"]["losses"])), (
            f"gradsync losses {r['gradsync']['losses']} != torch DDP's {r['torch']['losses']}"
        )
    assert_equal(ours["first_grads"], theirs["first_grads"], "gradsync vs torch DDP: first averaged gradients")
    assert_equal(ours["weights"], theirs["weights"], "gradsync vs torch DDP: final weights")
    assert not torch.equal(r0["gradsync"]["seen"][0], r1["gradsync"]["seen"][0]), "both ranks got the same batch"
    # The hand reference: not necessarily bitwise (with accumulation it sums in another order).
    hand = _clipped(r0["hand_first_grads"])
    diff = max_diff(ours["first_grads"], hand)
    assert diff <= 1e-6, f"the first averaged gradient is {diff:.3g} from the hand reference"
    for rank, r in enumerate(ranks):  # teeth: a rank's own gradient, never averaged, is far from it
        local = max_diff(_clipped(r["local_first_grads"]), hand)
        assert local > 1e-4, f"rank {rank}: its own gradient is only {local:.3g} from the average"
    if "loss_shifted" in r0:
        for rank, r in enumerate(ranks):
            first = r["gradsync"]["losses"][0]
            assert torch.allclose(first, r["loss_shifted"], rtol=1e-5), f"rank {rank}: first loss {first}"
            assert abs(float(r["loss_unshifted"] - r["loss_shifted"])) > 1e-3, "shifting makes no difference here"
