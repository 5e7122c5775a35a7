"""The optimizer's options, as the engine declares them (``FLEXDEMO_OPTIMIZER_OPTIONS`` in
include/flexdemo/optim.h): names, types, help, and each step's defaults, read from the extension
so that Python, ``flexdemo train`` and the C++ library default to the same step.

    flexdemo.options.table()               # [(name, type, help), ...] in declaration order
    flexdemo.options.defaults("flexdemo")  # {name: value} of a step: flexdemo, flexdemo-adamw, demo
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

_ops = torch.ops.flexdemo

# The reference DeMo's keywords (and a few shorter ones) for the engine's options.
ALIASES = {
    "compression_decay": "decay",
    "compression_topk": "topk",
    "compression_chunk": "chunk",
    "exchange_every": "replicate_every",
    "exchange": "demo_exchange",
    "overlap": "overlap_step",
    "on_bad_peer": "peer_policy",
}
STEPS = ("flexdemo", "flexdemo-adamw", "demo")


def table() -> List[Tuple[str, str, str]]:
    """Every option as (name, type, help): type "float", "int", "bool" or the accepted words
    ("sgd|adamw|nesterov")."""
    return [tuple(row) for row in _ops.option_table()]


def _typed(kind: str, word: str):
    if kind == "float":
        return float(word)
    if kind == "int":
        return int(word)
    if kind == "bool":
        return word == "true"
    return word


def _word(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def preset_of(inner: str) -> str:
    """The step a FlexDeMo(inner=...) starts from."""
    return "flexdemo-adamw" if inner == "adamw" else "flexdemo"


def given(options: Dict) -> Dict[str, object]:
    """Keywords as the engine names them (aliases resolved, betas split); an unknown keyword is
    a TypeError naming it, as Python's own would be."""
    known = {name for name, _, _ in table()}
    out = {}
    for key, value in options.items():
        if key == "betas":
            betas = tuple(value)
            if len(betas) != 2:
                raise ValueError("flexdemo: betas {}; two numbers in [0, 1)".format(betas))
            out["beta1"], out["beta2"] = float(betas[0]), float(betas[1])
            continue
        name = ALIASES.get(key, key)
        if name not in known:
            raise TypeError("flexdemo: unknown option '{}'; the options: {}".format(
                key, ", ".join(sorted(known | set(ALIASES) | {"betas"}))))
        out[name] = value
    return out


def spelling(keywords) -> List[str]:
    """How the engine's messages name the options given under an alias: as they were given."""
    return ["{}={}".format(ALIASES[k], k) for k in keywords if k in ALIASES]


def words(options: Dict[str, object]) -> List[str]:
    return ["{}={}".format(name, _word(value)) for name, value in options.items()]


def resolve(step: str, options: Dict[str, object], keywords=()) -> Dict[str, object]:
    """Every option of `step` with these given (checked by the engine: a ValueError names the
    bad one as `keywords`, the caller's, spell it)."""
    kinds = {name: kind for name, kind, _ in table()}
    out = {}
    for pair in _ops.resolved_options(step, words(options), spelling(keywords)):
        name, _, word = pair.partition("=")
        out[name] = _typed(kinds[name], word)
    return out


def defaults(step: str = "flexdemo") -> Dict[str, object]:
    """A step's defaults: flexdemo (FlexDeMo's), flexdemo-adamw (inner "adamw"), demo (DeMo's)."""
    return resolve(step, {})
