"""What the three Hugging Face examples share: the CPU process-group recipe, a small causal LM built from a
config (nothing downloaded) and token data it can learn from."""

import os

import torch


def cpu_process_group_if_no_gpu() -> None:
    """On a host without a GPU, accelerate keeps ``backend=None`` for DeepSpeed and counts one process; set up
    the gloo group it should use (each rank, before the Trainer / Accelerator is made)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
        from accelerate import PartialState

        PartialState(backend="gloo")


def accelerator_config() -> dict:
    """TrainingArguments' accelerator_config: use the process group set up above (CPU hosts)."""
    return {} if torch.cuda.is_available() else {"use_configured_state": True}


def tiny_llama(vocab: int = 256):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return transformers.LlamaForCausalLM(cfg)


class CountingData(torch.utils.data.Dataset):
    """Sequences that count upwards modulo the vocabulary from a random start: learnable in a few hundred steps."""

    def __init__(self, n: int = 2048, seq: int = 64, vocab: int = 256):
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        start = torch.randint(2, self.vocab, (1,), generator=torch.Generator().manual_seed(i))
        ids = (start + torch.arange(self.seq)) % (self.vocab - 2) + 2
        return {"input_ids": ids, "labels": ids}
