"""Building the config: YAML preset + environment + dotted overrides, one `ConfigError` that
names the key; flattening for logging; the reference tables the docs site renders."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from hybrid_engine.config.base import UNREGISTERED, ConfigError, RegisteredName, Section
from hybrid_engine.config.root import _YAML_DATA, HybridConfig
from hybrid_engine.registry import ADV_ESTIMATORS, REGISTRIES, estimator_needs


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["actor.optim.lr=1e-6", "rollout.n=8"]` -> nested dict; values parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:  # e.g. a !!python/... tag: refused, nothing runs
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(
                f"override {key.strip()}: the value is not plain YAML ({problem})"
            ) from None
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override")
        node[parts[-1]] = value
    return out


# a secret's name: one of these words in it, words split at `_`, `-`, `.` and camelCase
SECRET_WORDS = re.compile(
    r"(^|_)(secrets?|token(?!_ids?(_|$))|passwords?|passwd|pwd|credentials?|api_?keys?|"
    r"access_?keys?|private_?keys?|authorization|auth_?header|cookies?|pat|dsn)($|_)"
)
# the password of a URL (`postgres://user:PASSWORD@host/db`), whatever its key
URL_PASSWORD = re.compile(r"([a-z][a-z0-9+.-]*://[^/:@\s]*:)[^@/\s]+(?=@)", re.I)
REDACTED = "<redacted>"


def secret_name(key: str) -> bool:
    """Whether `key` names a secret (`AWS_SECRET_ACCESS_KEY`, `HF_TOKEN`, `Authorization`,
    `private-key`, `privateKey`, `GITHUB_PAT`, `db.password` ...)."""
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key).lower()
    return bool(SECRET_WORDS.search(re.sub(r"[^a-z0-9]+", "_", words)))


def redact(doc: Any, key: str = "") -> Any:
    """A config dump as it may be recorded (MLflow, run.json, summary.json, events): the
    value of a secret-looking name in its maps (`ray.worker_env`,
    `rollout.multi_turn.env_kwargs`), whatever its type but bool/None, becomes "<redacted>",
    and so does the password of any URL in a string (`DATABASE_URL`, `tracking.uri`)."""
    if key and secret_name(key) and doc is not None and not isinstance(doc, bool):
        return REDACTED
    if isinstance(doc, dict):
        return {k: redact(v, str(k)) for k, v in doc.items()}
    if isinstance(doc, list):
        return [redact(v) for v in doc]
    if isinstance(doc, str):
        return URL_PASSWORD.sub(r"\1" + REDACTED, doc)
    return doc


def redacted_keys(cfg: BaseModel) -> list[str]:
    """Keys of `cfg` whose value still holds "<redacted>" (a resumed run's secret not given
    again)."""
    out = []
    for key, value in flatten(cfg).items():
        if isinstance(value, dict):
            out += [f"{key}.{k}" for k, v in value.items() if isinstance(v, str) and REDACTED in v]
        elif isinstance(value, str) and REDACTED in value:
            out.append(key)
    return out


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            shown = "hidden" if secret_name(key.rpartition(".")[2]) else repr(e["input"])
            lines.append(f"unknown key {key!r} (value {shown})")
        elif e["type"] == UNREGISTERED:
            lines.append(f"{key}={e['input']!r} {e['msg']}")
        elif key and e["type"] != "value_error":  # our own validators name the key
            lines.append(f"{key}={e['input']!r}: {e['msg']}")
        else:
            lines.append(e["msg"].removeprefix("Value error, "))
    return "; ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> HybridConfig:
    """Build the config from a YAML preset, the environment, and dotted overrides."""
    data = read_preset(path) if path is not None else {}
    return config_from_dict(data, overrides)


def read_preset(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML preset as a dict. `extends: other.yaml` (relative to this file) starts from that
    preset: this file's keys replace its keys, section by section, at any depth."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    if p.resolve() in _seen:
        raise ConfigError(f"config file {str(p)!r} extends itself (through {_seen[-1].name})")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"config file {str(p)!r}: extends must be a file name, got {base!r}")
    return _merge(read_preset(p.parent / base, (*_seen, p.resolve())), data)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def config_from_dict(data: dict[str, Any], overrides: list[str] | None = None) -> HybridConfig:
    """Like `load_config`, from a dict in place of the YAML file (a stored run's config)."""
    _check_environment()
    token = _YAML_DATA.set(data)
    try:
        return HybridConfig(**parse_overrides(overrides or []))
    except ValidationError as e:
        raise ConfigError(f"invalid config: {_describe(e)}") from None
    finally:
        _YAML_DATA.reset(token)


def _check_environment() -> None:
    """`HYBRIDRL_<SECTION>__<KEY>` variables must name a section: pydantic-settings reads only
    the sections it knows, so a typo in one (`HYBRIDRL_ROLOUT__N`) would be ignored."""
    for name in sorted(os.environ):
        if name.startswith("HYBRIDRL_") and "__" in name:
            section = name.removeprefix("HYBRIDRL_").split("__")[0].lower()
            if section not in HybridConfig.model_fields:
                raise ConfigError(
                    f"environment variable {name}: no config section {section!r} "
                    f"(sections: {', '.join(HybridConfig.model_fields)})"
                )


def flatten(cfg: BaseModel, prefix: str = "") -> dict[str, Any]:
    """`{"actor.optim.lr": 1e-05, ...}` for logging and comparing runs."""
    out: dict[str, Any] = {}
    for name, value in cfg:
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            out |= flatten(value, key + ".")
        else:
            out[key] = value
    return out


def reads_of(model: type[BaseModel] = HybridConfig) -> dict[str, tuple[str, ...]]:
    """Every key -> who reads it (`config.base.READERS`), as its fields declare: the nearest
    declaration on the key or a section above it; () when none does."""
    out: dict[str, tuple[str, ...]] = {}

    def walk(cls: type[BaseModel], prefix: str, inherited: tuple[str, ...]) -> None:
        for name, field in cls.model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            who = tuple(extra.get("read_by", inherited))
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                walk(sub, f"{prefix}{name}.", who)
            else:
                out[prefix + name] = who

    walk(model, "", ())
    return out


# ----------------------------------------------------------------------------- reference
def _type_name(annotation: Any) -> str:
    """`int`, `float | None`, `"hf" \\| "vllm"` for the reference table."""
    args = get_args(annotation)
    named = [m for m in getattr(annotation, "__metadata__", ()) if isinstance(m, RegisteredName)]
    if named:
        return f"a registered {named[0].registry.kind}"
    if get_origin(annotation) is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if args and get_origin(annotation) in (UnionType, Union):
        return " \\| ".join(_type_name(a) for a in args)
    if annotation is type(None):
        return "None"
    if get_origin(annotation) in (dict, tuple):
        return str(annotation).replace("typing.", "")
    return getattr(annotation, "__name__", str(annotation))


def _bounds(metadata: list[Any]) -> str:
    signs = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}
    out = [f"{s} {getattr(m, k)}" for m in metadata for k, s in signs.items() if hasattr(m, k)]
    return f" ({', '.join(out)})" if out else ""


def config_reference() -> str:
    """Every key of the config as markdown tables (key, default, type, meaning), one per
    section, from the model itself (the docs' configuration reference is this text)."""
    lines: list[str] = []

    def walk(model: BaseModel, prefix: str) -> None:
        leaves = []
        for name, field in type(model).model_fields.items():
            value = getattr(model, name)
            if isinstance(value, BaseModel):
                continue
            default = "`None`" if value is None else f"`{json.dumps(value)}`"
            named = [m for m in field.metadata if isinstance(m, RegisteredName)]
            kind = (
                f"a registered {named[0].registry.kind}" if named else _type_name(field.annotation)
            )
            kind += _bounds(field.metadata)
            leaves.append(f"| `{prefix}{name}` | {default} | {kind} | {field.description or ''} |")
        if leaves:
            lines.extend(["", f"**{prefix.rstrip('.')}**", ""])
            doc = type(model).__doc__
            if doc and type(model) is not Section:
                lines.extend([" ".join(doc.split()), ""])
            lines.extend(["| key | default | type | meaning |", "| --- | --- | --- | --- |"])
            lines.extend(leaves)
        for name in type(model).model_fields:
            value = getattr(model, name)
            if isinstance(value, BaseModel):
                walk(value, f"{prefix}{name}.")

    defaults = {
        name: f.get_default(call_default_factory=True)
        for name, f in HybridConfig.model_fields.items()
    }
    for name, section in defaults.items():
        walk(section, f"{name}.")
    return "\n".join(lines).strip() + "\n"


_NEEDS = {
    "values": "a critic",
    "index": "prompt groups (rollout.n ≥ 2)",
    "reward_baselines": "a greedy rollout per prompt",
}


def registry_keys() -> dict[str, list[str]]:
    """Registry variable -> the config keys whose values are its names."""
    out: dict[str, list[str]] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            regs = [m.registry.var for m in field.metadata if isinstance(m, RegisteredName)]
            for arg in get_args(field.annotation):  # `ISLevel | None`
                regs += [
                    m.registry.var
                    for m in getattr(arg, "__metadata__", ())
                    if isinstance(m, RegisteredName)
                ]
            for var in regs + ([extra["registry"]] if "registry" in extra else []):
                out.setdefault(var, []).append(prefix + name)
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                walk(sub, f"{prefix}{name}.")

    walk(HybridConfig, "")
    return out


def registries_reference() -> str:
    """Every registry's names as markdown, one section per registry, read from the registries
    (their modules' source; with the plugins imported, a user's own appear too)."""
    keys = registry_keys()
    lines: list[str] = []
    for reg in REGISTRIES:
        used = ", ".join(f"`{k}`" for k in keys.get(reg.var, [])) or "—"
        lines += ["", f"## {reg.kind[0].upper()}{reg.kind[1:]}s", ""]
        lines += [
            f'Config: {used}. Yours: `@{reg.var}.register("name")` (`hybrid_engine.registry`) '
            "in a module listed in `algorithm.plugins`.",
            "",
        ]
        lines += ["| name | what | registered with |", "| --- | --- | --- |"]
        for name in reg:
            info = dict(reg.info(name))
            summary = " ".join(info.pop("summary").split()).replace("|", "\\|")
            info.pop("required")
            notes = [f"{k}={v!r}" for k, v in info.items()]
            if reg is ADV_ESTIMATORS:
                notes = [_NEEDS[n] for n in sorted(estimator_needs(name))] or ["needs nothing more"]
            lines.append(f"| `{name}` | {summary} | {', '.join(notes) or '—'} |")
    return "\n".join(lines).strip() + "\n"
