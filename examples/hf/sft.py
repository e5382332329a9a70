"""TRL's SFTTrainer on zengine (``pip install trl``), with a DeepSpeed config in its SFTConfig.

    zengine --deepspeed_compat --num_procs 2 examples/hf/sft.py --stage 3 --out /tmp/hf_sft

(``--num_gpus N`` on a GPU host.) Fine-tunes the small Llama on pre-tokenized counting sequences.
"""

import argparse

import datasets
import trl

from common import CountingData, accelerator_config, cpu_process_group_if_no_gpu, tiny_llama


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="/tmp/hf_sft")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    cpu_process_group_if_no_gpu()
    data = CountingData()
    rows = datasets.Dataset.from_dict(
        {"input_ids": [data[i]["input_ids"].tolist() for i in range(len(data))]}
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": args.stage,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }
    config = trl.SFTConfig(
        output_dir=args.out,
        deepspeed=ds_config,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=args.steps,
        learning_rate=3e-3,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        bf16=False,
        dataset_kwargs={"skip_prepare_dataset": True},
        accelerator_config=accelerator_config(),
    )
    trainer = trl.SFTTrainer(
        model=tiny_llama(), args=config, train_dataset=rows, processing_class=_tokenizer()
    )
    result = trainer.train()
    trainer.save_model(args.out + "/final")
    if trainer.is_world_process_zero():
        print(
            f"trained {result.global_step} steps, mean loss {result.training_loss:.4f}; "
            f"model saved to {args.out}/final"
        )


def _tokenizer(vocab: int = 256):
    """A word-level tokenizer over the model's vocabulary (SFTTrainer wants one; nothing downloaded)."""
    import tokenizers
    import transformers

    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t1", eos_token="t1"
    )


if __name__ == "__main__":
    main()
