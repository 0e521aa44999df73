"""`python -m trainer.sweep`: Cloud-style hyperparameter sweeps on one machine.

Modules: `main` (flags, the entry point), `config` (hptuning_config.yaml),
`space` (Optuna distributions and samplers), `study` (the study in sweep.db),
`preflight` (a dry run of the trainer before the first trial), `runner`
and `trials` (trial processes), `process`, `devices`, `metrics`,
`hparams` (TensorBoard HParams), `report` (results table). The sweep runs
`trainer.task` processes; it imports neither the estimator_towers library
nor TensorFlow (tests/test_imports.py checks).
"""
