"""Hydra's and OmegaConf's multi-line composition errors -> one line naming the key and the fix."""
from __future__ import annotations

import dataclasses
import difflib

from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from rptrain.train.errors import USER_ERRORS, one_line


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def _did_you_mean(key: str, object_type: object) -> str:
    if not dataclasses.is_dataclass(object_type):
        return ""
    names = [f.name for f in dataclasses.fields(object_type) if not f.name.startswith("_")]
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], names, n=1)
    return f" (did you mean {key.rsplit('.', 1)[0] + '.' if '.' in key else ''}{close[0]}?)" if close else ""


_WANTED = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}


def _fix_for(message: str) -> str:
    """OmegaConf says what failed; add what to write instead."""
    for name, wanted in _WANTED.items():
        if message.rstrip(".").endswith(f"converted to {name}"):
            return f": give {wanted}"
    if "is not a valid bool" in message:
        return ": give true or false"
    return ""


def describe(err: BaseException) -> str:
    """One line for any error a user's command line or config can cause."""
    if isinstance(err, USER_ERRORS):
        return one_line(err)
    if isinstance(err, MissingConfigException) and err.options and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, name = err.missing_cfg_file.rsplit("/", 1)
        return f"{group}={name} is not an option of {group}: choose one of {', '.join(sorted(err.options))}"
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and getattr(cause, "full_key", None):
        key = cause.full_key
        hint = _did_you_mean(key, getattr(cause, "object_type", None))
        return f"{key} is not a config key{hint}: check the spelling; `rptrain --cfg job` prints every key"
    if isinstance(cause, ValidationError) and getattr(cause, "full_key", None):
        return f"bad value for {cause.full_key}: {_first_line(cause)}{_fix_for(_first_line(cause))}"
    if isinstance(err, OverrideParseException):
        lines = [line.strip() for line in str(err).splitlines() if line.strip()][:2]
        return f"cannot parse the override: {' '.join(lines)} (grammar: https://hydra.cc/docs/advanced/override_grammar/basic/)"
    first = _first_line(err)
    if first.startswith("Ambiguous value"):
        return f"{first}: add -m (--multirun) to sweep over the values, or write a list as key=[a,b]"
    if cause is not err:
        return f"{first} {_first_line(cause)}"
    return first
