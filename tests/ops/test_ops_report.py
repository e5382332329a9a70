"""zengine-report: versions, CPU features and every op's status."""

from __future__ import annotations

from zengine.ops import ALL_OPS
from zengine.ops.report import collect, main


def test_report_lists_every_op(capsys):
    assert main(["--no-gemm"]) == 0
    text = capsys.readouterr().out
    for key in ("torch", "compiler", "ninja", "cpu_features"):
        assert key in text
    for spec in ALL_OPS:
        assert spec.name in text


def test_collect_states(monkeypatch):
    monkeypatch.setenv("ZENGINE_DISABLE_OPS", "unscale_norm")
    report = collect()
    states = {name: state for name, (state, _, _) in report["ops"].items()}
    assert set(states) == {spec.name for spec in ALL_OPS}
    assert states["unscale_norm"] in (
        "disabled",
        "built",
        "prebuilt",
    )  # already loaded ones stay loaded
    assert all(
        s in ("prebuilt", "built", "can be built", "disabled", "unavailable")
        for s in states.values()
    )


def test_report_shows_the_bf16_matmul_choice_and_rates(capsys, monkeypatch):
    from zengine.precision import cpu_matmul

    small = cpu_matmul.measure_gemm_rates
    monkeypatch.setattr(
        cpu_matmul, "measure_gemm_rates", lambda: small(tokens=8, width=64, budget_s=0.001)
    )
    assert main([]) == 0
    text = capsys.readouterr().out
    assert "bf16_cpu_matmul" in text and ("native (auto: " in text or "fp32 (auto: " in text)
    rows = {line.split()[0] for line in text.splitlines()[-5:]}
    assert {"fp32", "bf16"} <= rows and "input grad g @ W" in text
