"""Hugging Face's Trainer on zengine: a DeepSpeed config handed to TrainingArguments, as with DeepSpeed.

    zengine --deepspeed_compat --num_procs 2 examples/hf/trainer.py --stage 3 --out /tmp/hf_trainer

(``--num_gpus N`` on a GPU host.) The config below is what Trainer users write ("auto" wherever the
Trainer's arguments decide); the model is a small Llama built from a config and saved whole at the end.
"""

import argparse

import transformers

from common import CountingData, accelerator_config, cpu_process_group_if_no_gpu, tiny_llama


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="/tmp/hf_trainer")
    parser.add_argument("--local_rank", type=int, default=-1)  # launchers may pass it
    args = parser.parse_args()
    cpu_process_group_if_no_gpu()
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": {
            "stage": args.stage,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }
    training = transformers.TrainingArguments(
        output_dir=args.out,
        deepspeed=ds_config,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=args.steps,
        learning_rate=3e-3,
        warmup_steps=5,
        logging_steps=10,
        save_strategy="steps",
        save_steps=args.steps // 2,
        report_to=[],
        disable_tqdm=True,
        accelerator_config=accelerator_config(),
    )
    trainer = transformers.Trainer(model=tiny_llama(), args=training, train_dataset=CountingData())
    result = trainer.train()
    trainer.save_model(args.out + "/final")
    if trainer.is_world_process_zero():
        print(
            f"trained {result.global_step} steps, mean loss {result.training_loss:.4f}; "
            f"model saved to {args.out}/final"
        )


if __name__ == "__main__":
    main()
