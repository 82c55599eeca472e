"""The one reader of ``params.yaml``: a stage's parameters for a profile.

``params.yaml`` holds a top-level ``profile`` (``cpu``, ``gpu`` or ``paper``;
``dvc repro`` uses it) and one section per stage::

    stage:
      defaults: {...}        # what every profile shares
      cpu:      {...}        # only what differs from the defaults
      gpu:      {...}
      paper:    {...}

The resolved parameters of ``stage`` under profile ``P`` are ``defaults``
deep-merged with ``stage[P]`` (mappings merge key by key, recursively; any
other value, lists included, replaces the default), then the dotted-key
``overrides`` (``--set a.b=1``) are applied. A section without ``defaults``
is read as before the split (``stage[P]`` alone). Every profile a stage
supports must be named in its section, even with an empty mapping, so that a
typo in the profile is an error and not the defaults.

Every consumer (:mod:`companion.pipeline`, the zoo-training CLIs,
``python -m companion.assets``) reads its parameters through
:func:`stage_params`; DVC tracks whole sections (``params: [profile, stage]``),
so editing a default or any profile re-runs the stage.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import IO, Any, Iterable, Mapping

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
PARAMS_FILE = REPO_ROOT / "params.yaml"
PROFILES = ("cpu", "gpu", "paper")
DEFAULTS = "defaults"


class ParamsError(KeyError):
    """``params.yaml`` or an override does not describe the requested stage/profile.

    A ``KeyError`` (a missing section or profile is a lookup failure) whose
    text is the plain message, not its ``repr``.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


#: PyYAML's safe loader over libyaml (``CSafeLoader``: the same constructor and resolver over a C parser) where
#: PyYAML was built with it, else the pure-Python ``SafeLoader``; tests/test_layout.py checks both give the same
#: objects for every YAML file of the repository. params.yaml and dvc.lock are read many times: 0.1-0.3 s each with
#: the pure-Python parser.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(source: str | bytes | IO) -> Any:
    """The companion's one YAML reader: ``yaml.safe_load``'s result for ``source`` (text or an open file), parsed
    by :data:`YAML_LOADER`."""
    return yaml.load(source, Loader=YAML_LOADER)


def load_params(path: str | os.PathLike = PARAMS_FILE) -> dict:
    """Read a parameter file; a missing or non-mapping file is an error."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"parameter file {path} does not exist")
    with open(path) as fh:
        data = load_yaml(fh)
    if not isinstance(data, dict):
        raise ParamsError(f"{path} must hold a mapping at top level, got {type(data).__name__}")
    return data


def default_profile(all_params: Mapping) -> str:
    """The file's top-level ``profile`` (``cpu`` when absent)."""
    return all_params.get("profile", "cpu")


def _merge(base: Mapping, over: Mapping) -> dict:
    """Deep merge: mappings key by key, anything else replaced by ``over``."""
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def resolve(all_params: Mapping, stage: str, profile: str | None = None) -> tuple[str, dict]:
    """``(profile, parameters)`` of ``stage`` from an already-read parameter mapping.

    A stage without a section resolves to ``{}`` (a stage may need none).
    """
    if profile is None:
        profile = default_profile(all_params)
    if profile not in PROFILES:
        raise ParamsError(f"unknown profile {profile!r}; expected one of {PROFILES}")
    section = all_params.get(stage)
    if section is None:
        return profile, {}
    if not isinstance(section, Mapping):
        raise ParamsError(f"params.yaml section {stage!r} must be a mapping of profiles")
    unknown = sorted(set(section) - set(PROFILES) - {DEFAULTS})
    if unknown:
        raise ParamsError(f"params.yaml section {stage!r} has keys {unknown} that are neither "
                          f"{DEFAULTS!r} nor a profile {PROFILES}; move them under {DEFAULTS!r} or a profile")
    if profile not in section:
        raise ParamsError(f"params.yaml section {stage!r} has no profile {profile!r} "
                          f"(has: {sorted(k for k in section if k != DEFAULTS)})")
    defaults = section.get(DEFAULTS) or {}
    specific = section[profile] or {}
    for name, part in ((DEFAULTS, defaults), (profile, specific)):
        if not isinstance(part, Mapping):
            raise ParamsError(f"params.yaml {stage}.{name} must be a mapping, got {type(part).__name__}")
    return profile, _merge(defaults, specific)


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Parse ``key=value`` strings; values are YAML (numbers, lists, booleans)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ParamsError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ParamsError(f"override {item!r} has an empty key")
        out[key] = load_yaml(value)
    return out


def apply_overrides(params: Mapping, overrides: Mapping[str, Any]) -> dict:
    """A deep copy of ``params`` with dotted-key overrides (``a.b``) applied."""
    result = json.loads(json.dumps(params))  # deep copy of plain data, as the pipeline always did
    for dotted, value in overrides.items():
        keys = dotted.split(".")
        node = result
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[keys[-1]] = value
    return result


def stage_params(
    stage: str,
    profile: str | None = None,
    overrides: Mapping[str, Any] | Iterable[str] = (),
    *,
    path: str | os.PathLike | None = None,
    params: Mapping | None = None,
) -> tuple[str, dict]:
    """``(profile, parameters)`` of ``stage``: defaults, the profile's changes, overrides.

    ``profile`` defaults to the file's top-level ``profile``; ``overrides`` is
    a mapping of dotted keys or ``key=value`` strings (YAML values). The file
    is ``path`` (default: the repository's ``params.yaml``), or ``params`` an
    already-read mapping.
    """
    all_params = params if params is not None else load_params(path if path is not None else PARAMS_FILE)
    profile, resolved = resolve(all_params, stage, profile)
    if not isinstance(overrides, Mapping):
        overrides = parse_overrides(overrides)
    return profile, apply_overrides(resolved, overrides)


# --------------------------------------------------------------------------- typed settings

def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` checked against (and, for nested settings and measures, built as) the type ``tp``."""
    import dataclasses
    import types
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, where)
            except ParamsError as exc:
                errors.append(str(exc))
        raise ParamsError(errors[0] if len(errors) == 1 else
                          f"{where} = {value!r} matches none of {[_type_name(a) for a in args]}")
    if _is_measure(tp):
        from hideseek import Measure
        try:
            return Measure.from_dict(value) if isinstance(value, Mapping) else Measure.parse(value)
        except (TypeError, ValueError) as exc:
            raise ParamsError(f"{where}: {exc}") from None
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ParamsError(f"{where} must be a mapping of {tp.__name__} fields, got {value!r}")
        return _from_mapping(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ParamsError(f"{where} must be a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ParamsError(f"{where} must have {len(args)} entries, got {len(value)}")
            return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ParamsError(f"{where} must be a mapping, got {value!r}")
        kt, vt = args or (Any, Any)
        return {_coerce(k, kt, f"{where} key"): _coerce(v, vt, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ParamsError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamsError(f"{where} must be an integer, got {value!r}")
        return value
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise ParamsError(f"{where} must be a {tp.__name__}, got {value!r}")
        return value
    if origin is typing.Literal:
        if value not in args:
            raise ParamsError(f"{where} must be one of {list(args)}, got {value!r}")
        return value
    raise ParamsError(f"{where}: settings field type {_type_name(tp)} is not supported by companion.params")


def _is_measure(tp: Any) -> bool:
    return getattr(tp, "__name__", None) == "Measure" and getattr(tp, "__module__", "").startswith("hideseek")


def _from_mapping(cls: type, data: Mapping, where: str):
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = {f.name for f in fields}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ParamsError(f"{where} has keys {unknown} that {cls.__name__} does not know "
                          f"(known: {sorted(names)}); fix the spelling in params.yaml")
    missing = [f.name for f in fields if f.name not in data]
    if missing:
        raise ParamsError(f"{where} is missing {missing}; add them to params.yaml "
                          f"(under the stage's defaults or its profile section)")
    return cls(**{f.name: _coerce(data[f.name], hints[f.name], f"{where}.{f.name}") for f in fields})


def from_mapping(cls: type, data: Mapping, where: str = "params"):
    """Typed settings ``cls`` from an already resolved mapping (what a notebook's ``params`` holds),
    with the checks of :func:`settings`; ``where`` names the source in error messages."""
    import dataclasses

    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"from_mapping() needs a dataclass type, got {cls!r}")
    if not isinstance(data, Mapping):
        raise ParamsError(f"{where} must be a mapping of {cls.__name__} fields, got {type(data).__name__}")
    return _from_mapping(cls, data, where)


def settings(cls: type, stage: str, profile: str | None = None,
             overrides: Mapping[str, Any] | Iterable[str] = (), *,
             path: str | os.PathLike | None = None, params: Mapping | None = None):
    """The typed settings of ``stage``: an instance of the dataclass ``cls``.

    The parameters are :func:`stage_params` (defaults, profile, overrides); then every
    field of ``cls`` must be present (no defaults live in code), no unknown key is
    accepted, and each value is checked against the field's annotation: ``int``,
    ``float`` (integers accepted), ``bool``, ``str``, ``Literal[...]``, ``X | None``,
    ``list[X]``, ``tuple[X, ...]``, ``dict[str, X]``, nested dataclasses, and
    :class:`hideseek.Measure` (a measure's name or its ``to_dict`` mapping). A mismatch is a
    one-line :class:`ParamsError` naming the dotted key.
    """
    import dataclasses

    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"settings() needs a dataclass type, got {cls!r}")
    resolved_profile, data = stage_params(stage, profile, overrides, path=path, params=params)
    return _from_mapping(cls, data, f"params.yaml {stage} ({resolved_profile})")


def resolve_all(path: str | os.PathLike | None = None) -> dict:
    """Every stage's parameters under every profile it names: ``{"profile", "stages": {stage: {profile: …}}}``.

    The resolved form ``tests/fixtures/params_resolved.json`` records, so that a
    change of what a stage actually receives shows up in review.
    """
    all_params = load_params(path if path is not None else PARAMS_FILE)
    stages: dict[str, dict] = {}
    for stage, section in all_params.items():
        if stage == "profile":
            continue
        for profile in (p for p in PROFILES if isinstance(section, Mapping) and p in section):
            stages.setdefault(stage, {})[profile] = resolve(all_params, stage, profile)[1]
    return {"profile": default_profile(all_params), "stages": stages}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m companion.params",
                                 description="Print a stage's resolved parameters (defaults + profile + overrides).")
    ap.add_argument("stage", nargs="?", help="stage name; omitted: every stage and profile, as JSON")
    ap.add_argument("--profile", choices=PROFILES, default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--params", default=str(PARAMS_FILE))
    args = ap.parse_args(argv)
    try:
        if args.stage is None:
            out = resolve_all(args.params)
        else:
            if args.stage not in load_params(args.params):
                raise ParamsError(f"{args.params} has no stage section {args.stage!r}")
            profile, resolved = stage_params(args.stage, args.profile, args.overrides, path=args.params)
            out = {"stage": args.stage, "profile": profile, "params": resolved}
    except ParamsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
