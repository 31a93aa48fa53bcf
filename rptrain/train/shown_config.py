"""What a run writes down of its config (its log, the console, checkpoints, experiment trackers): the
resolved values, except those that come from the environment (`${oc.env:WANDB_API_KEY}`, and any
value that resolves through one), which stay as written. A secret handed over in the environment
must not end up in files and dashboards that get shared. (.hydra/config.yaml is Hydra's own copy,
unresolved.) A config read back from a checkpoint resolves such a value again where it is read.
"""
from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig, OmegaConf

_ENV = re.compile(r"\$\{\s*oc\.env\s*:")


def shown_config(cfg: DictConfig) -> dict:
    resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    raw = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    secrets: set[str] = set()
    _collect(resolved, raw, secrets)
    return _keep(resolved, raw, {s for s in secrets if len(s) >= 4})  # shorter values would match everywhere


def _collect(resolved: Any, raw: Any, secrets: set[str]) -> None:
    """The resolved values of every `${oc.env:...}` interpolation."""
    for r, w in _pairs(resolved, raw):
        if isinstance(w, str) and _ENV.search(w):
            if r is not None and not isinstance(r, (dict, list)):
                secrets.add(str(r))
        else:
            _collect(r, w, secrets)


def _keep(resolved: Any, raw: Any, secrets: set[str]) -> Any:
    if isinstance(resolved, dict) and isinstance(raw, dict):
        return {k: _keep(v, raw.get(k), secrets) for k, v in resolved.items()}
    if isinstance(resolved, list) and isinstance(raw, list) and len(resolved) == len(raw):
        return [_keep(v, w, secrets) for v, w in zip(resolved, raw)]
    from_env = isinstance(raw, str) and (_ENV.search(raw) or ("${" in raw and any(s in str(resolved) for s in secrets)))
    return raw if from_env else resolved


def _pairs(resolved: Any, raw: Any) -> list[tuple[Any, Any]]:
    if isinstance(resolved, dict) and isinstance(raw, dict):
        return [(v, raw.get(k)) for k, v in resolved.items()]
    if isinstance(resolved, list) and isinstance(raw, list) and len(resolved) == len(raw):
        return list(zip(resolved, raw))
    return []
