"""The autotuner, ``zengine --autotuning tune|run``: cli.py (the command), space.py (the candidates),
model.py (memory and step-time predictions), trials.py (one trial), tuner.py (the search), report.py
(the results). Inside each trial the engine measures with engine/trial_probe.py."""
