"""Lightning's offload presets on zengine (issue 46): ``DeepSpeedStrategy(stage=2,
offload_optimizer=True)`` (``"deepspeed_stage_2_offload"``) and ``DeepSpeedStrategy(stage=3,
offload_optimizer=True, offload_parameters=True)`` (``"deepspeed_stage_3_offload"``), with the
offload sections Lightning writes (``nvme_path``, ``buffer_count``, ``max_in_cpu`` ...), 2 gloo
ranks, the script run as a user would (``lightning_runs.py``). After 2 steps and a save, Lightning's
converter gives plain torch's weights on the global batch (<1e-6).
"""

import importlib.util

import pytest

from lightning_runs import MICRO, WORLD, check_converted, named, plain, run_script

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_lightning") is None,
    reason="the test extra installs pytorch-lightning",
)

BODY = '''
offloads = [(2, dict(offload_optimizer=True)),
            (3, dict(offload_optimizer=True, offload_parameters=True))]
for stage, offload in offloads:
    fitted = trainer(stage, 2, **offload)
    fitted.fit(Net(seed=0))
    name = os.path.join(out, f"offload{stage}")
    fitted.save_checkpoint(name)
    if fitted.is_global_zero:
        convert_zero_checkpoint_to_fp32_state_dict(name, name + ".pt")
    fitted.strategy.barrier()
'''


def test_trainer_with_lightnings_offload_presets(tmp_path):
    run_script(tmp_path, BODY)
    for _, model, _, _ in plain(MICRO * WORLD, 2):
        reference = named(model)
    for stage in (2, 3):
        check_converted(tmp_path, f"offload{stage}", 2, reference)
