"""Fine-tune with ``transformers.Trainer`` on "tpu", step by step against CPU.

Tiny models from configs (no hub): a Llama causal LM and a BERT sequence classifier,
seeded weights, a fixed random dataset. ``run(...)`` trains on the device asked for and
returns the per-step losses, the eval loss and the trainer; the tests and
``bench/hf.py`` use it too. Nothing torchjax-specific is needed beyond ``import
torchjax``: the Trainer picks "tpu" as torch's accelerator.

Run:  python -m examples.hf_trainer    (20 steps of each model, cpu and tpu, then eval)
"""

from __future__ import annotations

import tempfile

import torch
import transformers as tf
from torch.utils.data import Dataset

VOCAB = 128
SEQ = 8


def llama_config(dropout: float = 0.0):
    return tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        attention_dropout=dropout, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def bert_config(dropout: float = 0.0):
    return tf.BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, num_labels=3,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )  # fmt: skip


class TokenDataset(Dataset):
    """``n`` rows of random token ids (fixed seed); labels are the ids (causal LM) or one
    of three classes (classifier)."""

    def __init__(self, n: int, task: str, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)
        self.classes = torch.randint(0, 3, (n,), generator=g)
        self.task = task

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i] if self.task == "causal_lm" else self.classes[i]
        return {"input_ids": self.ids[i], "labels": labels}


def model(task: str, dropout: float = 0.0, seed: int = 0):
    torch.manual_seed(seed)
    if task == "causal_lm":
        return tf.LlamaForCausalLM(llama_config(dropout))
    return tf.BertForSequenceClassification(bert_config(dropout))


def run(
    device: str,
    task: str = "causal_lm",
    steps: int = 4,
    output_dir: str | None = None,
    resume: str | None = None,
    dropout: float = 0.0,
    evaluate: bool = False,
    **args,
):
    """Train ``task``'s tiny model for ``steps`` on ``device`` ("cpu" or "tpu"); returns
    (losses per logged step, eval loss or None, trainer)."""
    output_dir = output_dir or tempfile.mkdtemp()
    training_args = tf.TrainingArguments(
        output_dir,
        max_steps=steps,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=device == "cpu",
        save_strategy=args.pop("save_strategy", "no"),
        seed=0,
        dataloader_pin_memory=False,
        disable_tqdm=True,
        **args,
    )
    trainer = tf.Trainer(
        model=model(task, dropout),
        args=training_args,
        train_dataset=TokenDataset(64, task),
        eval_dataset=TokenDataset(8, task, seed=1) if evaluate else None,
    )
    trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    eval_loss = trainer.evaluate()["eval_loss"] if evaluate else None
    return losses, eval_loss, trainer


def main() -> None:
    import torchjax  # noqa: F401  (makes "tpu" torch's accelerator)

    for task in ("causal_lm", "classifier"):
        cpu, cpu_eval, _ = run("cpu", task, steps=20, evaluate=True)
        tpu, tpu_eval, _ = run("tpu", task, steps=20, evaluate=True)
        print(f"{task}: step  cpu loss  tpu loss")
        for step in cpu:
            print(f"  {step:4d}  {cpu[step]:.6f}  {tpu[step]:.6f}")
        print(f"  eval  {cpu_eval:.6f}  {tpu_eval:.6f}")


if __name__ == "__main__":
    main()
