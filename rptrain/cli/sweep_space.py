"""The jobs preflight checks for a -m sweep, in the basic sweeper's syntax and in Optuna's.

The basic sweeper runs every combination of lists (a,b), choice(), range() and glob(): each is a
job to check. Optuna (hydra/sweeper=optuna) samples interval(a,b) and tag(log, interval(a,b))
too; the values it will draw are unknown, so both ends of an interval are checked (a value that
composes at both ends composes in between). The basic sweeper cannot run an interval: that is
one line too, instead of Hydra's report after the sweep folder exists.
"""
from __future__ import annotations

import itertools
from typing import Any, Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig

from rptrain.train.errors import ConfigError


def _values(override: Override) -> list[str]:
    if not override.is_sweep_override():
        return [override.get_value_element_as_str()]
    if override.is_interval_sweep():
        interval = override.value()
        return [str(interval.start), str(interval.end)]
    return list(override.sweep_string_iterator())


def sweep_jobs(overrides: list[str], config_loader: Optional[Any] = None) -> list[list[str]]:
    """One override list per job to check (config_loader: for glob(), which lists a group's options)."""
    parsed = OverridesParser.create(config_loader).parse_overrides(overrides)
    per_key = [[f"{o.get_key_element()}={v}" for v in _values(o)] for o in parsed]
    return [list(job) for job in itertools.product(*per_key)]


def check_sweeper(hydra_cfg: DictConfig, overrides: list[str]) -> None:
    """An interval needs a sampling sweeper (Optuna); the basic sweeper would fail after starting."""
    if not str(hydra_cfg.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_interval_sweep():
            raise ConfigError(f"{o.input_line}: interval() is sampled by a sweeper such as Optuna: add hydra/sweeper=optuna, or list the values (a,b,c) or use range()")
