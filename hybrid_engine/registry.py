"""Registries: names -> implementations, one per registered kind, filled by one decorator.

    @ADV_ESTIMATORS.register("grpo")
    def grpo(token_level_rewards, response_mask, index, ...): ...

    ADV_ESTIMATORS["grpo"]            # the function (imports the module that defines it)
    list(ADV_ESTIMATORS)              # the names, without importing it
    ADV_ESTIMATORS.info("gae")        # decorator keywords, required parameters, summary

A registry is the one source of its names: the config's checks and types, the engine's
dispatch and the reference docs read it. Each registry knows the modules that define its
built-in entries (`homes`). Its names and their `info` are read from those modules' source
(the `register` decorators, with literal arguments) so that checking a config imports
neither torch nor any backend; looking an entry up imports them. A test checks that what
the source says equals what importing it registers. Entries registered at run time (a
plugin module of `algorithm.plugins`) join both views. A name registered twice by two
different definitions is refused, naming both.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
_ROOT = Path(__file__).resolve().parent.parent  # the directory holding hybrid_engine/


class UnknownNameError(KeyError, ValueError):
    """A name no registry entry has; both a KeyError and a ValueError."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def _where(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"


def _summary(doc: str | None) -> str:
    return " ".join(inspect.cleandoc(doc or "").split("\n\n")[0].split())


def _required(params: list[str], defaults: int) -> tuple[str, ...]:
    return tuple(params[: len(params) - defaults])


class Registry(Mapping[str, Any]):
    """The entries of one kind. `var` is the registry's name in this module (the source scan
    looks for `@<var>.register(...)`); `kind` names it in messages."""

    def __init__(self, var: str, kind: str, *homes: str) -> None:
        self.var, self.kind, self.homes = var, kind, homes
        self._entries: dict[str, tuple[Any, dict[str, Any]]] = {}
        self._loaded = False

    # ------------------------------------------------------------------ registering
    def register(self, name: str, **info: Any) -> Callable[[T], T]:
        """Decorator: register the function or class as `name`, with `info` (literals)."""

        def add(obj: T) -> T:
            if name in self._entries and _where(self._entries[name][0]) != _where(obj):
                raise ValueError(
                    f"{self.kind} {name!r} is registered twice: by "
                    f"{_where(self._entries[name][0])} and by {_where(obj)}"
                )
            self._entries[name] = (obj, info)
            return obj

        return add

    def unregister(self, name: str) -> None:
        """Remove an entry registered at run time (tests)."""
        del self._entries[name]

    # ------------------------------------------------------------------ reading
    def __getitem__(self, name: str) -> Any:
        self.load()
        if name not in self._entries:
            known = ", ".join(sorted(self))
            raise UnknownNameError(f"unknown {self.kind} {name!r}; known: {known}")
        return self._entries[name][0]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(set(self._static) | set(self._entries)))

    def __len__(self) -> int:
        return len(set(self._static) | set(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._static or name in self._entries

    def info(self, name: str) -> dict[str, Any]:
        """The decorator's keywords plus `required` (parameters without a default) and
        `summary` (the docstring's first paragraph), without importing the entry's module."""
        if name in self._entries:
            obj, info = self._entries[name]
            fn = obj.__init__ if isinstance(obj, type) else obj
            params = inspect.signature(fn).parameters.values()
            required = tuple(
                p.name
                for p in params
                if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and p.name != "self"
            )
            return {**info, "required": required, "summary": _summary(obj.__doc__)}
        if name in self._static:
            return self._static[name]
        raise UnknownNameError(f"unknown {self.kind} {name!r}; known: {', '.join(self)}")

    def check(self, name: str, key: str) -> str:
        """`name` if registered, else a ValueError naming the config key and the choices."""
        if name not in self:
            raise ValueError(
                f"{key}={name!r} is not a registered {self.kind}; registered: {', '.join(self)}"
            )
        return name

    def load(self) -> None:
        """Import the modules that register the built-in entries (once: lookups sit on hot
        paths such as the loss aggregation of every micro-batch)."""
        if not self._loaded:
            for home in self.homes:
                importlib.import_module(home)
            self._loaded = True

    # ------------------------------------------------------------------ the source scan
    @cached_property
    def _static(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for home in self.homes:
            path = _ROOT.joinpath(*home.split(".")).with_suffix(".py")
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    for dec in node.decorator_list:
                        if (entry := self._registration(dec, path)) is not None:
                            out[entry[0]] = {**entry[1], **_node_facts(node)}
        return out

    def _registration(self, dec: ast.expr, path: Path) -> tuple[str, dict[str, Any]] | None:
        if not (
            isinstance(dec, ast.Call)
            and isinstance(dec.func, ast.Attribute)
            and dec.func.attr == "register"
            and isinstance(dec.func.value, ast.Name)
            and dec.func.value.id == self.var
        ):
            return None
        try:
            (name,) = (ast.literal_eval(a) for a in dec.args)
            info = {k.arg: ast.literal_eval(k.value) for k in dec.keywords}
        except ValueError:
            raise ValueError(
                f"{path}:{dec.lineno}: {self.var}.register takes literal arguments only"
            ) from None
        return name, info


def _node_facts(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> dict[str, Any]:
    """`required` and `summary` of a decorated function (or of a class's __init__)."""
    fn = node
    if isinstance(node, ast.ClassDef):
        inits = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
        fn = inits[0] if inits else None
    required: tuple[str, ...] = ()
    if fn is not None:
        a = fn.args
        positional = [p.arg for p in a.posonlyargs + a.args if p.arg != "self"]
        required = _required(positional, len(a.defaults))
        required += tuple(
            k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None
        )
    return {"required": required, "summary": _summary(ast.get_docstring(node))}


# ---------------------------------------------------------------------- the registries
ADV_ESTIMATORS = Registry(
    "ADV_ESTIMATORS", "advantage estimator", "hybrid_engine.algorithms.advantages"
)
# What an estimator may require beyond rewards and mask (parameters without a default).
ESTIMATOR_INPUTS = {
    "values": "values (a critic)",
    "index": "index (a group id per sample)",
    "reward_baselines": "reward_baselines (the rewards of a greedy rollout)",
}


def estimator_needs(name: str) -> frozenset[str]:
    """The inputs estimator `name` requires among ESTIMATOR_INPUTS, read from its signature:
    the registry is the one source of what the engine must build for it (a critic, prompt
    groups: rollout.n >= 2, a greedy rollout per prompt)."""
    return frozenset(p for p in ESTIMATOR_INPUTS if p in ADV_ESTIMATORS.info(name)["required"])


POLICY_LOSSES = Registry("POLICY_LOSSES", "policy loss", "hybrid_engine.algorithms.losses")
LOSS_AGG_MODES = Registry(
    "LOSS_AGG_MODES", "loss aggregation mode", "hybrid_engine.algorithms.losses"
)
KL_ESTIMATORS = Registry("KL_ESTIMATORS", "KL estimator", "hybrid_engine.algorithms.kl")
IS_LEVELS = Registry("IS_LEVELS", "IS level", "hybrid_engine.algorithms.correction")
REJECTION_MODES = Registry(
    "REJECTION_MODES", "rejection mode", "hybrid_engine.algorithms.correction"
)
ENVIRONMENTS = Registry(
    "ENVIRONMENTS",
    "environment",
    "hybrid_engine.rollout.envs.feedback",
    "hybrid_engine.rollout.envs.tools",
)
ROLLOUT_BACKENDS = Registry(
    "ROLLOUT_BACKENDS", "rollout backend", "hybrid_engine.rollout.hf", "hybrid_engine.rollout.vllm"
)
REGISTRIES = tuple(v for v in list(globals().values()) if isinstance(v, Registry))
