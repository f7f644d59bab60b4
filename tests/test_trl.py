"""TRL's trainers (GRPO, SFT, DPO) through ``with_distamp`` on 2 gloo processes (CPU).

A tiny Qwen2 (one layer, hidden size 16, built from its config) and a character tokenizer made
here (no hub access). GRPO samples 4-token completions of 2-character prompts and is rewarded
for each ``a``. One 2-rank job runs every scenario (the imports dominate a start):

- GRPO through distamp, an inf written into rank 1's gradient after DDP's all-reduce at step 2
  (a ``training_step`` override): both ranks skip that step, the scheduler holds, the
  parameters end bitwise equal and finite; the rollouts' ``generate`` and the training forward
  run in fp16 (a Linear's output dtype); logs carry ``loss_scale`` and ``skipped_steps``;
- the same run with stock TRL: fp32 on CPU, only rank 1 sees the inf, the ranks diverge;
- the distamp run resumed from its step-2 checkpoint (the Trainer's own save and resume) ends
  bitwise where the uninterrupted run ended;
- SFT and DPO (an explicit reference model) through distamp: fp16, bitwise-equal ranks.

- GRPO with ``use_transformers_continuous_batching=True`` (TRL casts the policy to fp16 in place
  to generate): refused at the first optimizer step on both ranks, naming the parameters.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs distamp[transformers]")
pytest.importorskip("accelerate", reason="needs distamp[transformers] (accelerate)")
pytest.importorskip("datasets", reason="needs distamp[trl] (datasets)")
pytest.importorskip("trl", reason="needs distamp[trl]")

from _dist import run_ranks

STEPS, BAD_STEP, SAVE_AT = 4, 2, 2
CHARS = "abcdefgh"


def _tokenizer() -> Any:
    """One token per character, made here: no hub access."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )


def _model(tok: Any) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    return Qwen2ForCausalLM(cfg)


def _digest(model: Any) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def _finite(model: Any) -> bool:
    return all(bool(p.detach().isfinite().all()) for p in model.parameters())


def _reward(completions: list[str], **kw: Any) -> list[float]:
    return [float(c.count("a")) for c in completions]


def _common(out: str, **extra: Any) -> dict[str, Any]:
    """The TrainingArguments every run shares (fp16, CPU, a few steps)."""
    settings = dict(
        output_dir=out, use_cpu=True, fp16=True, max_steps=STEPS, per_device_train_batch_size=2,
        learning_rate=1e-2, lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=1,
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, seed=0,
        save_strategy="no",
    )  # fmt: skip
    return {**settings, **extra}


def _grpo(rank: int, out: str, distamp: bool, **extra: Any) -> Any:
    """GRPO with rank 1's gradient set to inf at :data:`BAD_STEP` (after the all-reduce)."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from distamp.integrations.transformers import with_distamp

    class InjectingGRPO(GRPOTrainer):  # type: ignore[misc]
        """A user's GRPOTrainer subclass: an inf in rank 1's gradient after backward."""

        def training_step(self, model: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
            loss = super().training_step(model, inputs, *args, **kw)
            if self.state.global_step == BAD_STEP and rank == 1:
                p = next(q for q in model.parameters() if q.grad is not None)
                p.grad.view(-1)[0] = float("inf")
            return loss

    tok = _tokenizer()
    model = _model(tok)
    seen: dict[str, set[str]] = {"generate": set(), "train": set()}
    model.model.layers[0].mlp.gate_proj.register_forward_hook(
        lambda _m, _i, o: seen["train" if torch.is_grad_enabled() else "generate"].add(str(o.dtype))
    )
    args = GRPOConfig(
        **_common(out, **extra), num_generations=2, max_completion_length=4, temperature=1.0
    )
    prompts = Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"] * 4})
    cls = with_distamp(InjectingGRPO) if distamp else InjectingGRPO
    trainer = cls(
        model=model, args=args, reward_funcs=_reward, train_dataset=prompts, processing_class=tok
    )
    return trainer, seen


def _record(trainer: Any) -> Any:
    from transformers import TrainerCallback

    class Record(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.skipped: list[bool] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.skipped.append(bool(trainer.accelerator.optimizer_step_was_skipped))

    record = Record()
    trainer.add_callback(record)
    return record


def _result(trainer: Any, record: Any, seen: dict[str, set[str]] | None = None) -> dict[str, Any]:
    logs = [e for e in trainer.state.log_history if "loss" in e]
    scaler = getattr(trainer.accelerator, "scaler", None)
    return {
        "skipped": record.skipped,
        "scheduler_steps": trainer.lr_scheduler.last_epoch,
        "digest": _digest(trainer.model),
        "finite": _finite(trainer.model),
        "scaler": type(scaler).__name__,
        "scale": None if scaler is None else scaler.get_scale(),
        "last_log": {k: logs[-1].get(k) for k in ("loss_scale", "skipped_steps")},
        "dtypes": {k: sorted(v) for k, v in (seen or {}).items()},
    }


def _sft(out: str) -> Any:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from distamp.integrations.transformers import with_distamp

    tok = _tokenizer()
    texts = Dataset.from_dict({"text": ["abcdefgh", "hgfedcba", "aabbccdd", "abab"] * 4})
    args = SFTConfig(**_common(out), max_length=12)
    return with_distamp(SFTTrainer)(
        model=_model(tok), args=args, train_dataset=texts, processing_class=tok
    )


def _dpo(out: str) -> Any:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from distamp.integrations.transformers import with_distamp

    tok = _tokenizer()
    pairs = Dataset.from_dict(
        {"prompt": ["ab", "cd"] * 8, "chosen": ["aa", "ca"] * 8, "rejected": ["bb", "dd"] * 8}
    )
    args = DPOConfig(**_common(out), max_length=12)
    return with_distamp(DPOTrainer)(
        model=_model(tok), ref_model=_model(tok), args=args, train_dataset=pairs,
        processing_class=tok,
    )  # fmt: skip


def _on_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    out: dict[str, Any] = {}
    save = {"save_strategy": "steps", "save_steps": SAVE_AT}
    # Stock TRL ends at the bad step: rank 1's weights are NaN after it, and its next rollout
    # would fail in sampling while rank 0 waits in the all-reduce.
    for name, distamp, extra in (
        ("distamp", True, save),
        ("stock", False, {"max_steps": BAD_STEP + 1}),
    ):
        trainer, seen = _grpo(rank, f"{root}/{name}", distamp, **extra)
        record = _record(trainer)
        trainer.train()
        out[name] = _result(trainer, record, seen)
    trainer, seen = _grpo(rank, f"{root}/distamp", True, **save)
    record = _record(trainer)
    trainer.train(resume_from_checkpoint=f"{root}/distamp/checkpoint-{SAVE_AT}")
    out["resumed"] = _result(trainer, record, seen)
    for name, build in (("sft", _sft), ("dpo", _dpo)):
        trainer = build(f"{root}/{name}")
        record = _record(trainer)
        trainer.train()
        out[name] = _result(trainer, record)
    # Last: both ranks raise at the same point (after the all-reduce, before any collective).
    out["continuous_batching"] = _continuous_batching(rank, f"{root}/cb")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("trl")
    return run_ranks(_on_ranks, 2, str(root), timeout=240)


def test_grpo_skips_an_inf_after_the_all_reduce_on_both_ranks(runs: list[dict[str, Any]]) -> None:
    r0, r1 = runs[0]["distamp"], runs[1]["distamp"]
    expected = [k == BAD_STEP for k in range(STEPS)]
    assert r0["skipped"] == r1["skipped"] == expected, (r0["skipped"], r1["skipped"])
    assert r0["scheduler_steps"] == r1["scheduler_steps"] == STEPS - 1
    assert r0["digest"] == r1["digest"]  # bitwise-equal parameters
    assert r0["finite"] and r1["finite"]
    assert r0["scaler"] == "DistributedGradScaler"
    assert r0["scale"] == r1["scale"] == 2.0**15  # one backoff from 65536
    assert r0["last_log"] == {"loss_scale": 2.0**15, "skipped_steps": 1}


def test_grpo_trains_and_generates_in_fp16(runs: list[dict[str, Any]]) -> None:
    """The rollouts (TRL's ``generate``, no grad) and the training forward both run in the
    training precision; stock TRL on the CPU runs both in fp32 although ``fp16=True``."""
    assert runs[0]["distamp"]["dtypes"] == {
        "generate": ["torch.float16"], "train": ["torch.float16"]
    }  # fmt: skip
    assert runs[0]["stock"]["dtypes"] == {
        "generate": ["torch.float32"], "train": ["torch.float32"]
    }  # fmt: skip


def test_stock_grpo_diverges_on_the_same_inf(runs: list[dict[str, Any]]) -> None:
    """For contrast: stock TRL, the same inf on rank 1 only: no skip anywhere, and the ranks'
    parameters differ (rank 1's clip turned its gradient into NaN; the run ends at that step,
    as rank 1's next rollout would fail in sampling)."""
    r0, r1 = runs[0]["stock"], runs[1]["stock"]
    assert r0["skipped"] == r1["skipped"] == [False] * (BAD_STEP + 1)
    assert r0["scheduler_steps"] == r1["scheduler_steps"] == BAD_STEP + 1
    assert r0["scaler"] == "NoneType"
    assert r0["digest"] != r1["digest"]
    assert r0["finite"] and not r1["finite"]


def test_grpo_resumes_bitwise_from_its_checkpoint(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        full, resumed = rank["distamp"], rank["resumed"]
        assert resumed["digest"] == full["digest"]
        assert resumed["scale"] == full["scale"]
        assert resumed["scheduler_steps"] == full["scheduler_steps"]
        assert resumed["last_log"] == full["last_log"]


@pytest.mark.parametrize("name", ["sft", "dpo"])
def test_sft_and_dpo_train_in_fp16_on_both_ranks(runs: list[dict[str, Any]], name: str) -> None:
    r0, r1 = runs[0][name], runs[1][name]
    assert r0["scaler"] == "DistributedGradScaler"
    assert r0["skipped"] == r1["skipped"] == [False] * STEPS
    assert r0["scheduler_steps"] == STEPS
    assert r0["digest"] == r1["digest"] and r0["finite"]
    assert r0["last_log"] == {"loss_scale": 2.0**16, "skipped_steps": 0}


# ---- TRL's continuous-batching rollouts cast the policy to fp16 in place --------------------


def _continuous_batching(rank: int, out: str) -> dict[str, Any]:
    """GRPO with ``use_transformers_continuous_batching=True``: its rollout casts the policy to
    fp16 in place (``unwrapped_model.to(torch.float16)``) and never back."""
    # A small cache: sized by default from the memory free (12 GB of RSS per rank measured).
    cache = {"num_blocks": 16, "max_batch_tokens": 64}
    trainer, _ = _grpo(
        rank,
        out,
        True,
        use_transformers_continuous_batching=True,
        transformers_continuous_batching_config=cache,
    )
    try:
        trainer.train()
    except ValueError as exc:
        opt = trainer.optimizer
        while hasattr(opt, "optimizer"):
            opt = opt.optimizer
        return {
            "message": str(exc),
            "step": trainer.state.global_step,
            "stepped": bool(opt.state),
            "scheduler_steps": trainer.lr_scheduler.last_epoch,
        }
    return {"message": None}


def test_continuous_batching_cast_is_refused_at_the_first_step(
    runs: list[dict[str, Any]],
) -> None:
    """The fp16 master weights TRL's continuous-batching rollout leaves behind are refused at
    the first optimizer step on both ranks, naming them, with nothing stepped."""
    for rank in runs:
        r = rank["continuous_batching"]
        assert r["message"] is not None, "the fp16 master weights were stepped"
        assert (
            "16-bit parameter(s) with no master: model.embed_tokens.weight (fp16)" in r["message"]
        )
        assert "use_transformers_continuous_batching" in r["message"]
        assert r["step"] == 0 and not r["stepped"] and r["scheduler_steps"] == 0


def test_with_distamp_refuses_what_is_not_a_trainer_class() -> None:
    import trl

    from distamp.integrations.transformers import with_distamp

    with pytest.raises(TypeError, match=r"GRPOConfig.*transformers\.Trainer subclass"):
        with_distamp(trl.GRPOConfig)


def test_trl_older_than_its_floor_is_refused_when_wrapped() -> None:
    """TRL's window (distamp.versions): older releases are refused with the install command;
    ``with_distamp`` checks it when given one of TRL's trainers."""
    from distamp.versions import WINDOWS, check_version

    window = WINDOWS["trl"]
    with pytest.raises(ImportError, match=r"trl 1\.6\.0 is older.*\.\[trl\]"):
        check_version("trl", installed="1.6.0")
    assert check_version("trl", installed=window.newest) == window.newest
