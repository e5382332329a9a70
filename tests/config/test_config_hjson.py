"""Config files are read with hjson, as DeepSpeed reads them: comments and trailing commas are
accepted, plain JSON reads exactly as ``json`` reads it, and whatever hjson makes of a file is
still type-checked by the models."""

import json
from pathlib import Path

import pytest

from zengine.config import ConfigError, load_config
from zengine.config.load import _read

REPO = Path(__file__).resolve().parents[2]

PLAIN = """{
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-4, "warmup_num_steps": 20}},
  "zero_optimization": {"stage": 2, "reduce_bucket_size": "5e7", "overlap_comm": true},
  "gradient_clipping": 1.0,
  "comm_timeout": 600
}
"""

COMMENTED = """// The same config as PLAIN, written the way DeepSpeed lets people write it.
{
  # batch: 4 per rank, 2 micro steps
  "train_micro_batch_size_per_gpu": 4,   // per rank
  "gradient_accumulation_steps": 2,
  "optimizer": {
    "type": "AdamW",
    "params": {
      "lr": 3e-4,
      "betas": [0.9, 0.999,],  # a trailing comma in a list
      "eps": 1e-8,
      "weight_decay": 0.01,
    },
  },
  /* a block comment
     over two lines */
  "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-4, "warmup_num_steps": 20,},},
  "zero_optimization": {"stage": 2, "reduce_bucket_size": "5e7", "overlap_comm": true,},
  "gradient_clipping": 1.0,
  "comm_timeout": 600,
}
"""


def _write(tmp_path, text, name="config.json"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _typed(value):
    """``value`` with the type of every leaf made part of it: 1 and 1.0 compare unequal."""
    if isinstance(value, dict):
        return {key: _typed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_typed(item) for item in value]
    return (type(value).__name__, value)


def _error(config) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, 1)
    return str(info.value)


def test_comments_and_trailing_commas_load_equal_to_plain_json(tmp_path):
    plain = load_config(_write(tmp_path, PLAIN, "plain.json"), 2)
    commented = load_config(_write(tmp_path, COMMENTED, "commented.json"), 2)
    assert commented.model_dump() == plain.model_dump()
    assert _typed(_read(tmp_path / "commented.json")[1]) == _typed(json.loads(PLAIN))
    assert commented.zero_optimization.stage == 2 and commented.train_batch_size == 16


@pytest.mark.parametrize(
    "path", sorted((REPO / "configs").glob("*.json")), ids=lambda path: path.name
)
def test_shipped_json_reads_exactly_as_json_reads_it(path):
    assert _typed(_read(path)[1]) == _typed(json.loads(path.read_text()))


def test_plain_json_keeps_every_type(tmp_path):
    text = json.dumps(
        {
            "a": 1.0,
            "b": 2,
            "c": 1e5,
            "d": -0.0,
            "e": "x // not a comment # nor this, ",
            "f": [1.5, 2, 3.0e0, [4.0]],
            "g": {"h": None, "i": True, "j": False},
            "k": "\u00e9\n\t\"",
            "l": 12345678901234567890,
            "m": 1e-8,
            "n": "",
            "o": [],
            "p": {},
        }
    )
    text = text.replace('"c": 100000.0', '"c": 1E5')  # an exponent without a fraction
    path = _write(tmp_path, text)
    assert _typed(_read(path)[1]) == _typed(json.loads(text))
    assert isinstance(_read(path)[1]["c"], float)


def test_a_decimal_stays_a_decimal(tmp_path):
    # hjson alone reads 2.0 as the int 2; the batch key must still see a decimal and refuse it.
    message = _error(
        _write(tmp_path, '{"train_micro_batch_size_per_gpu": 2.0, "gradient_clipping": 2.0}')
    )
    assert (
        "train_micro_batch_size_per_gpu: expected an integer, not a decimal number (2.0)" in message
    )
    assert "gradient_clipping" not in message
    cfg = load_config(
        _write(tmp_path, '{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 2.0}'), 1
    )
    assert isinstance(cfg.gradient_clipping, float) and cfg.train_micro_batch_size_per_gpu == 2


def test_syntax_error_names_the_file_and_the_line(tmp_path):
    path = _write(
        tmp_path,
        '// comment\n{\n  "train_batch_size": 8,  # eight\n  "fp16": {"enabled" true}\n}\n',
    )
    message = _error(path)
    assert str(path) in message and "line 4, column 22" in message


def test_unclosed_object_names_the_file_and_a_line(tmp_path):
    path = _write(tmp_path, '{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true}\n')
    message = _error(path)
    assert str(path) in message and "line 4" in message


def test_duplicate_keys_are_still_refused(tmp_path):
    path = _write(tmp_path, '{\n  "train_batch_size": 8, // first\n  "train_batch_size": 16,\n}')
    assert "'train_batch_size' appears twice" in _error(path)


def test_empty_file_is_named(tmp_path):
    path = _write(tmp_path, "  \n")
    assert f"config file is empty: {path}" in _error(path)


def test_unquoted_values_that_read_as_json_values_load(tmp_path):
    text = (
        "{\n  train_micro_batch_size_per_gpu: 2\n  fp16: {\n    enabled: true\n  }\n"
        "  zero_optimization: {\n    stage: 2\n  }\n  optimizer: {\n    type: AdamW\n"
        "    params: {\n      lr: 3e-4\n    }\n  }\n}\n"
    )
    cfg = load_config(_write(tmp_path, text), 1)
    assert cfg.zero_optimization.stage == 2 and cfg.fp16.enabled is True
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params == {"lr": 3e-4}


def test_unquoted_words_are_type_checked(tmp_path):
    # Valid hjson, never valid JSON: bare words are strings, and a bare value runs to the end of
    # the line, comma included. The models refuse each of them by key path.
    text = (
        '{\n  "train_micro_batch_size_per_gpu": 2,\n  "fp16": {"enabled": yes\n  },\n'
        '  "zero_optimization": {"stage": two\n  },\n'
        '  "optimizer": {"type": "AdamW", "params": {"lr": auto,\n    "eps": 1e-8}}\n}\n'
    )
    message = _error(_write(tmp_path, text))
    assert "fp16.enabled: Input should be a valid boolean (got 'yes')" in message
    assert "zero_optimization.stage: expected an integer, got 'two'" in message
    assert "optimizer.params.lr: must be a number, got 'auto,'" in message
    assert "comma included" in message
