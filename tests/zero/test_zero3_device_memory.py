"""Stage 3's device memory at DeepSpeed's defaults, counted on the stand-in device (``device_memory.py``).

What ``torch.cuda.max_memory_allocated`` reports on a GPU, counted here on ``meta`` by the line that
made each storage: a 4-block GPT, bf16, W = 2, DeepSpeed's stage-3 defaults (reuse distance and live
parameters 1e9, reduce bucket 5e8) with the prefetch window one block, as 5e7 is a block of a
billion-parameter model, and the persistence threshold 4 x d_model (vectors whole, matrices sharded). With 'module' units (DeepSpeed's lifetimes) the whole model is gathered at the
turn from forward to backward and every gradient waits in one bucket; 'auto' (units.py) keeps a used
parameter only within the window and reduces about a block at a time, as FSDP2: the peak drops by
both, and the values stay those of 'module' (test_zero_gather_units.py).
"""

from device_guard import run_on_meta

WORLD, STEPS = 2, 3
# a block of the GPT below: 12 d^2 matrix elements (and a few vectors)
D_MODEL, LAYERS, VOCAB, SEQ = 128, 4, 256, 32
WINDOW = 12 * D_MODEL**2 + 16 * D_MODEL


def _peak(units: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zengine
    from device_guard import DeviceRulesMode, FakeCollectives, HostReads, side_streams_on_meta
    from device_memory import DeviceMemory
    from zengine.models.gpt import GPT, GPTConfig

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    memory = DeviceMemory()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": WINDOW,
            # vectors whole, matrices sharded: what 1e5 does to a billion-parameter model's layers
            "stage3_param_persistence_threshold": 4 * D_MODEL,
            "stage3_gather_units": units,
        },
    }
    try:
        guards = (HostReads(WORLD).installed(), FakeCollectives().installed())
        with guards[0], guards[1], side_streams_on_meta(), DeviceRulesMode(), memory:
            cfg = GPTConfig(
                vocab_size=VOCAB, seq_len=SEQ, n_layer=LAYERS, n_head=4, d_model=D_MODEL
            )
            with torch.device("meta"):
                model = GPT(cfg)
            numel = sum(p.numel() for p in model.parameters())
            engine, *_ = zengine.initialize(model=model, config=config)
            for _ in range(STEPS):
                x = torch.randint(0, VOCAB, (2, SEQ), device="meta")
                engine.backward(engine(x, x))
                memory.phase("step", counts=False)  # (foreach Adam on meta)
                engine.step()
                memory.phase("next")
        sites = memory.peak_sites()
        return {
            "numel": numel,
            "peak": memory.peak,
            "gathered": sum(
                b for s, b in sites.items() if s.startswith("zengine/zero/stage3/param")
            ),
            "buckets": sum(b for s, b in sites.items() if "bucket_buffers" in s),
        }
    finally:
        dist.destroy_process_group()


def test_auto_units_hold_a_window_of_parameters_and_gradients_not_the_model():
    module, auto = run_on_meta(_peak, "module"), run_on_meta(_peak, "auto")
    half = 2 * module["numel"]  # the whole model in bf16
    # DeepSpeed's lifetimes: every parameter gathered at the peak, every gradient in one bucket
    assert module["gathered"] >= 0.95 * half, module
    assert module["buckets"] >= 0.95 * half, module
    # 'auto': at most the window behind, the window ahead and the block running; buckets of a block
    # (the one filling and those in flight with overlap_comm)
    assert auto["gathered"] <= 2 * 3 * WINDOW, auto
    assert auto["buckets"] <= 2 * 3 * WINDOW, auto
    # the peak moves later into the backward, where activations' gradients peak: of the 4 bytes a
    # parameter freed at the turn of the step, 1.39 come off the peak here (15.00 -> 13.61)
    saved = module["peak"] - auto["peak"]
    assert saved >= 0.5 * half, (module, auto)
