"""What a user can name in a config, read from the registries themselves (so it cannot go stale): algorithms with
every hyper-parameter, its type, default and range; models with their options; presets; datasets."""

from __future__ import annotations

import inspect
import re
import typing

from pydantic.fields import FieldInfo

SECTIONS = ("algorithms", "models", "presets", "datasets")
#: a preset's ``# runtime: ~2 h (estimated: ...)`` comment: what the whole run takes on a 2-core CPU, and how
#: that was found
RUNTIME = re.compile(r"# runtime: ([^(]*[^(\s])")


def _summary(obj) -> str:
    """The first paragraph of a docstring, on one line."""
    return " ".join((inspect.getdoc(obj) or "").split("\n\n")[0].split())


def _type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _range(info: FieldInfo) -> str:
    bounds = []
    for m in info.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                bounds.append(f"{sign} {getattr(m, attr):g}")
    return ", ".join(bounds)


def field_lines(model) -> list[str]:
    """``name: type = default  (range)  description`` for every field of a pydantic model."""
    lines = []
    for name, info in model.model_fields.items():
        rng = _range(info)
        default = "(required)" if info.is_required() else f"= {info.get_default(call_default_factory=True)!r}"
        lines.append(f"{name}: {_type_name(info.annotation)} {default}"
                     + (f"  ({rng})" if rng else "") + (f"  {info.description}" if info.description else ""))
    return lines


def algorithms() -> list[str]:
    from ..algorithms import ALGORITHMS
    from ..engine import robust

    out = []
    for name in sorted(ALGORITHMS):
        algo = ALGORITHMS[name]
        # an algorithm's own docstring, else its module's (one module per algorithm, as a rule)
        doc = _summary(algo) if algo.__doc__ else _summary(inspect.getmodule(algo))
        kind = ("global model" if algo.global_model else
                "no global model (part of the weights averaged: one architecture)" if algo.shares_weights else
                "no global model (architectures may differ)")
        kind += ", personalized" if algo.personalized else ""
        kind += ("; takes aggregation:, attack:, privacy:" if robust.eligible(algo) else  # (its robust stages)
                 "; takes aggregation:, attack:" if robust.averaged(algo) else "")
        out.append(f"{name:10s} {kind}. {doc}")
        out += [f"    {line}" for line in field_lines(algo.Config)] or ["    (no hyper-parameters)"]
    return out


def models() -> list[str]:
    from ..models import MODELS

    out = []
    for name in sorted(MODELS):
        factory = MODELS[name]
        target = factory.__init__ if inspect.isclass(factory) else factory
        params = list(inspect.signature(target).parameters.values())
        options = [p for p in params if p.name not in ("self", "input_shape", "num_classes")
                   and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        shown = ", ".join(f"{p.name}={p.default!r}" if p.default is not p.empty else p.name for p in options)
        doc = _summary(factory)
        out.append(f"{name:12s} options: {shown or '-':24s} {doc}")
    return out


def presets() -> list[str]:
    """Each preset's first comment line, after its expected runtime: the TIME of its ``# runtime: TIME (how it
    was found)`` comment, '?' where it has none."""
    import yaml

    from ..presets import preset_names, preset_path

    out = [f"{'':28s} {'runtime':>13s}  (of one method, the preset's algorithm, on one thread of a 2-core CPU, ~ = "
           "estimated; x N: `fedmosaic run NAME` runs the N methods its compare: lists, each its own time)"]
    for name in preset_names():
        text = preset_path(name).read_text()
        lines = text.splitlines()
        about = _first_sentence(lines)
        runtime = next((m[1] for m in map(RUNTIME.match, lines) if m), "?")
        methods = len(yaml.safe_load(text).get("compare") or [])
        runtime += f" x {methods}" if methods > 1 else ""
        out.append(f"{name:28s} {runtime:>13s}  {about}")
    return out


def _first_sentence(lines: list[str], limit: int = 200) -> str:
    """The first sentence of a preset's opening comment, however many lines it takes; beyond ``limit`` characters
    cut at a word, marked with an ellipsis (never silently mid-sentence)."""
    words = []
    for line in lines:
        if not line.startswith("#") or RUNTIME.match(line):
            break
        words.append(line.lstrip("# ").strip())
    text = " ".join(w for w in words if w)
    end = re.search(r"(?<!e\.g)(?<!i\.e)(?<!Fig)(?<!Tab)(?<!Eq)(?<!al)(?<!vs)\.(\s|$)", text)
    text = text[: end.start() + 1] if end else text
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " …"


def datasets() -> list[str]:
    from ..data.registry import REGISTRY, dataset_names, find_layout

    out = []
    for name in dataset_names():
        spec = REGISTRY[name]
        where = "built-in" if spec.builtin else ("found" if find_layout(spec) else "missing")
        out.append(f"{name:18s} {where:8s} {spec.description}")
    return out


def catalog(sections: list[str]) -> str:
    parts = []
    for section in sections:
        parts.append(f"{section}:\n" + "\n".join(f"  {line}" for line in globals()[section]()))
    return "\n\n".join(parts)
