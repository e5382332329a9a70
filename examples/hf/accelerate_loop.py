"""accelerate with a DeepSpeedPlugin on zengine: a user's own loop, as in accelerate's examples.

    zengine --deepspeed_compat --num_procs 2 examples/hf/accelerate_loop.py --stage 3 --out /tmp/hf_accelerate

(``--num_gpus N`` on a GPU host.) Trains, saves the whole state with ``save_state`` and the model with
``get_state_dict`` + ``save_pretrained``.
"""

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

from common import CountingData, cpu_process_group_if_no_gpu, tiny_llama


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="/tmp/hf_accelerate")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    cpu_process_group_if_no_gpu()
    plugin = DeepSpeedPlugin(
        zero_stage=args.stage,
        gradient_accumulation_steps=2,
        gradient_clipping=1.0,
        zero3_save_16bit_model=True,
    )
    acc = Accelerator(deepspeed_plugin=plugin)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(CountingData(), batch_size=8, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    step = 0
    while step < args.steps:
        for batch in loader:
            with acc.accumulate(model):
                loss = model(**batch).loss
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            if acc.sync_gradients:
                step += 1
                if step % 10 == 0:
                    acc.print(f"step {step:4d} | loss {loss.item():.4f}")
                if step == args.steps:
                    break
    acc.save_state(args.out + "/state")
    state = acc.get_state_dict(model)
    acc.unwrap_model(model).save_pretrained(
        args.out + "/final", state_dict=state, is_main_process=acc.is_main_process
    )
    acc.print(f"saved the training state to {args.out}/state and the model to {args.out}/final")


if __name__ == "__main__":
    main()
