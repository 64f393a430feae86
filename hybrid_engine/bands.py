"""The threshold strings of rollout correction, parsed (standard library only: the config
checks them, the correction applies them): one number, or a "lower_upper" band."""

from __future__ import annotations

from hybrid_engine.registry import REJECTION_MODES


def _band(spec: float | str, what: str, band: bool = True) -> tuple[float | None, float]:
    """(lower, upper) from "lower_upper" (when `band`) or one number (lower None), checked
    0 < lower <= upper; the error names `what`."""
    if isinstance(spec, bool):
        raise ValueError(f"{what}: expected a number, got {spec!r}")
    lower_s, sep, upper_s = str(spec).strip().partition("_")
    form = "a number or 'lower_upper'" if band else "one upper bound"
    try:
        if sep and not band:
            raise ValueError
        upper, lower = (float(upper_s), float(lower_s)) if sep else (float(lower_s), None)
    except ValueError:
        raise ValueError(f"{what} {spec!r}: expected {form}") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"{what} {spec!r}: need 0 < lower <= upper")
    return lower, upper


def parse_is_threshold(threshold: float | str) -> tuple[float, float | None]:
    """(upper, lower): a number or "2.0" truncates at upper (TIS, lower None); "0.5_2.0"
    keeps weights inside [lower, upper] and zeroes the rest (IcePop)."""
    lower, upper = _band(threshold, "IS threshold")
    return upper, lower


def parse_rejection(modes: str, thresholds: float | str) -> dict[str, tuple[float | None, float]]:
    """{mode: (lower, upper)} from comma-separated modes and thresholds (one shared, or one
    per mode). k1 modes bound the rollout/train ratio: "lower_upper", or "upper" meaning
    [1/upper, upper]; k2/k3 modes take one upper bound on the divergence."""
    names = list(dict.fromkeys(m.strip() for m in str(modes).split(",") if m.strip()))
    if not names:
        raise ValueError("rejection modes: give at least one of " + ", ".join(REJECTION_MODES))
    for name in names:
        if name not in REJECTION_MODES:
            raise ValueError(
                f"unknown rejection mode {name!r}; known: {', '.join(REJECTION_MODES)}"
            )
    specs = [s.strip() for s in str(thresholds).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"rejection thresholds {thresholds!r}: give one for all modes or one per mode "
            f"({len(names)})"
        )
    specs = specs * len(names) if len(specs) == 1 else specs
    out: dict[str, tuple[float | None, float]] = {}
    for name, spec in zip(names, specs, strict=True):
        k1 = REJECTION_MODES.info(name)["k"] == "k1"
        lower, upper = _band(spec, f"rejection threshold for {name}", band=k1)
        out[name] = (1.0 / upper if k1 and lower is None else lower, upper)
    return out
