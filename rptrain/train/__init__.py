"""The training library behind the `rptrain` CLI (nanoGPT/torchtune style: plain modules, one idea each).

  schema.py      dataclass schemas of every config group, registered in Hydra's ConfigStore
  validate.py    checks a schema cannot express (batch vs microbatches, model vs data, files)
  model.py       model group -> nn.Sequential (rptrain.models.build_model), checkpoint fingerprint
  data.py        data group -> train/eval loaders (tensor or torchvision pipeline, text, synthetic)
  precision.py   dtypes and the GradScaler
  run_config.py  run_config group -> rptrain.RoundPipeRunConfig
  schedule.py    warmup + constant/cosine LR schedule
  tasks.py       one training step and one evaluation, for classifiers and language models
  loop.py        Trainer: setup / train (the loop, evaluations) / save / cleanup
  setup.py       Components: engine, optimizer, schedule, data, task, meters, report, checkpoints, typed
  step_fn.py     what each engine.step runs (clip, optimizer, schedule) and the watch for non-finite losses
  report.py      step and epoch lines, metrics files and curves, the summary
  meters.py      running sums and the run's position
  checkpoint.py  atomic, checksummed checkpoint files, keep-last-N; resume.py: which checkpoint trainer.resume means
  run_checkpoints.py  what a run saves in a checkpoint and restores from one
  explain.py     rptrain --explain: the engine's plan and actions for one batch of a config, without training
  rundir.py      each run claims its own directory and owns it (lock) while it runs
  metrics.py     metrics.jsonl / metrics.csv; plots.py: curves.png; console.py: tree, bar, lines
  signals.py     SIGTERM/SIGINT -> checkpoint and stop; status.py: status.json
  dist.py        under torchrun: the process group, the trainer's small collectives, failed peers
  sweep.py       Hydra callback writing the sweep summary
  errors.py      ConfigError, CheckpointError, OutputError, NonFiniteLoss: user errors, printed as one line (exit code 2)
"""
from .errors import USER_ERRORS, CheckpointError, ConfigError
from .loop import Trainer
from .schema import register_configs

__all__ = ["Trainer", "register_configs", "ConfigError", "CheckpointError", "USER_ERRORS"]
