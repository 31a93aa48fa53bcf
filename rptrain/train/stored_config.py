"""A config read back from a file (a checkpoint's, a run's .hydra/config.yaml) -> a checked DictConfig.

Such a file is data: whoever wrote it must not choose what code runs. So nothing read from one is
ever passed to Hydra's `instantiate`: the model is rebuilt by name from the model registry
(train/model.py), and the config itself must fit the same closed schema a command line composes
into: the model and data sections the schema their option names (conf/model/NAME.yaml's
`/schema/model/X`), the rest rptrain_schema. An unknown key, a wrong type, a `_target_` other
than the known builder at its known place, or any other of Hydra's instantiation keys anywhere is
refused with one line naming the file and the key.
"""
from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import CheckpointError, one_line
from .schema import RPTrainConfig, register_configs

# The only places a stored config may carry a `_target_`, and what it may name there: the model's builder,
# and (never built from a stored config: a resume builds them from its own command line) a public name
# under rptrain.optim, rptrain.train.schedule or rptrain's GradScaler.
KNOWN_TARGETS: dict[str, str] = {"model": "rptrain.models.build_model", "precision.grad_scaler": "rptrain.GradScaler"}
TARGET_MODULES: dict[str, str] = {"optim.optimizer": "rptrain.optim", "optim.schedule": "rptrain.train.schedule"}
_HYDRA_KEYS = ("_target_", "_args_", "_partial_", "_recursive_", "_convert_")
_OPTION = re.compile(r"[a-z0-9_]+")


def checked_config(raw: Any, source: str) -> DictConfig:
    """`raw` (a dict as stored) as a config of the schema; CheckpointError naming `source` otherwise."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: the stored config is a {type(raw).__name__}, not a mapping: it was not written by rptrain")
    try:
        resolved = _resolved(OmegaConf.create(raw))
    except (OmegaConfBaseException, ValueError, TypeError) as err:
        raise CheckpointError(f"{source}: the stored config cannot be read ({one_line(err)[:200]})") from err
    _check_targets(resolved, "", source)
    register_configs()
    rest = {k: v for k, v in resolved.items() if k not in ("model", "data")}
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RPTrainConfig), rest)
        for group in ("model", "data"):
            section = resolved.get(group)
            if not isinstance(section, dict):
                raise CheckpointError(f"{source}: the stored config has no {group} section: it was not written by rptrain")
            cfg[group] = OmegaConf.merge(_schema(group, section.get("name"), source), section)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or ""
        raise CheckpointError(f"{source}: the stored config does not fit rptrain's schema at {key or 'its top level'} "
                              f"({one_line(err).split(chr(10))[0][:200]}): it was not written by this rptrain") from err
    return cfg


def _resolved(node: Any) -> Any:
    """The plain values, interpolations resolved where they can be here; one that cannot (an environment
    variable of the machine that wrote it, shown_config.py keeps those as written) stays as written."""
    from omegaconf import ListConfig

    if not isinstance(node, (DictConfig, ListConfig)):
        return node
    raw = OmegaConf.to_container(node, resolve=False, enum_to_str=True)
    keys = list(node.keys()) if isinstance(node, DictConfig) else range(len(node))
    out = {} if isinstance(node, DictConfig) else [None] * len(node)
    for k in keys:
        try:
            value = node[k]
        except OmegaConfBaseException:
            value = raw[k]
        out[k] = value.replace("${", "\\${") if isinstance(value, str) else _resolved(value)  # a literal from here on
    return out


def _check_targets(node: Any, where: str, source: str) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_targets(item, f"{where}[{i}]", source)
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        place = f"{where}.{key}" if where else str(key)
        if key in _HYDRA_KEYS and not _allowed(where, key, value):
            raise CheckpointError(f"{source}: the stored config has {place}={str(value)[:80]!r}: a config read from a file "
                                  f"may not name code to run; refused (rebuild from the run's own config)")
        _check_targets(value, place, source)


def _allowed(where: str, key: str, value: Any) -> bool:
    if key != "_target_" or not isinstance(value, str):
        return False
    if where in TARGET_MODULES:  # a public attribute path inside an already imported rptrain module: nothing is imported
        import importlib

        module = TARGET_MODULES[where]
        parts = value.removeprefix(module + ".").split(".") if value.startswith(module + ".") else []
        if not parts or not all(p.isidentifier() and not p.startswith("_") for p in parts):
            return False
        found: Any = importlib.import_module(module)
        for part in parts:
            found = getattr(found, part, None)
        return callable(found) and str(getattr(found, "__module__", "")).startswith(module)  # not os.system through an import
    return KNOWN_TARGETS.get(where) == value


def _schema(group: str, name: Any, source: str) -> DictConfig:
    """The schema of option NAME of `group`, as its conf/GROUP/*.yaml names it (`/schema/GROUP/X@_here_`)."""
    options = {p.name.removesuffix(".yaml"): p for p in resources.files("rptrain.conf").joinpath(group).iterdir()
               if p.name.endswith(".yaml")}
    wanted = next((p for option, p in options.items() if _option_name(p) == name), None) if isinstance(name, str) else None
    if wanted is None or not _OPTION.fullmatch(str(name)):
        raise CheckpointError(f"{source}: the stored config's {group}.name={str(name)[:80]!r} is not one of this rptrain's "
                              f"{group} options ({', '.join(sorted(options))})")
    schema = next((d.split("@")[0].removeprefix("/") for d in _defaults(wanted) if isinstance(d, str) and d.startswith(f"/schema/{group}/")), None)
    node = ConfigStore.instance().load(f"{schema}.yaml").node
    return OmegaConf.structured(node._metadata.object_type)


def _option_name(path: Any) -> Any:
    """The `name:` an option file sets (model=llama_tiny sets name: llama_tiny; hf sets hf)."""
    return _load(path).get("name", Path(str(path)).stem)


def _defaults(path: Any) -> list:
    return _load(path).get("defaults") or []


def _load(path: Any) -> dict:
    loaded = yaml.safe_load(path.read_text())
    return loaded if isinstance(loaded, dict) else {}
