"""Which runner a model gets (generate or pooling) and how a pooling model pools (vLLM's PoolerConfig, defined in
pagemill/config/pooling.py and re-exported here).

Pooling settings come, in order of precedence, from the user's `pooler_config`, the model's sentence-transformers
files (modules.json, its Pooling module's config.json, sentence_bert_config.json) and the architecture's default.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pagemill.config.pooling import (POOLING_ARCHITECTURES, POOLING_TYPES, RUNNERS, TASK_RUNNERS,  # noqa: F401
                                     PoolerConfig)

_ST_POOLING_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
                     "pooling_mode_lasttoken": "LAST"}
_ST_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens")
_ST_MODULES = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
               "sentence_transformers.models.Normalize")


def architecture(hf_config: Any) -> str:
    """The config's first architecture name (its model_type if none)."""
    archs = getattr(hf_config, "architectures", None) or []
    return archs[0] if archs else getattr(hf_config, "model_type", "")


def resolve_runner(runner: str, task: str | None, hf_config: Any) -> str:
    """generate or pooling, from `runner` (auto: pooling for pooling-only architectures) and vLLM's `task` alias."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}.")
    if task is not None:
        if task not in TASK_RUNNERS:
            raise ValueError(f"task must be one of {', '.join(TASK_RUNNERS)}, got {task!r}.")
        if runner != "auto" and runner != TASK_RUNNERS[task]:
            raise ValueError(f"task={task!r} needs runner={TASK_RUNNERS[task]!r}, got runner={runner!r}.")
        runner = TASK_RUNNERS[task]
    arch = architecture(hf_config)
    pooling_only = arch in POOLING_ARCHITECTURES
    if runner == "auto":
        return "pooling" if pooling_only else "generate"
    if runner == "generate" and pooling_only:
        raise ValueError(f"runner='generate': {arch} is a pooling model (it has no LM head); use runner='pooling'.")
    return runner


def resolve_pooler_config(user: dict[str, Any] | str | PoolerConfig | None, model_path: str,
                          hf_config: Any) -> PoolerConfig:
    """The pooler of a model run with runner='pooling': user settings over sentence-transformers files over the
    architecture's default (CLS for BERT, LAST for decoders; embeddings normalised)."""
    config = PoolerConfig.from_user(user)
    arch = architecture(hf_config)
    config.head = POOLING_ARCHITECTURES.get(arch, "embed")
    config.encoder_only = arch in POOLING_ARCHITECTURES
    st = read_sentence_transformers(model_path) if os.path.isdir(model_path) else {}
    if config.pooling_type is None:
        config.pooling_type = st.get("pooling_type") or ("CLS" if config.encoder_only else "LAST")
    if config.normalize is None:
        config.normalize = st.get("normalize", True)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    config.matryoshka_dimensions = list(dims) if dims else None
    config.is_matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or dims)
    config.max_seq_length = st.get("max_seq_length")
    return config


def read_sentence_transformers(model_dir: str) -> dict[str, Any]:
    """pooling_type, normalize and max_seq_length from a sentence-transformers model directory ({} if it is not
    one); a module or pooling mode this engine does not implement is a ValueError rather than a wrong vector."""
    out: dict[str, Any] = {}
    bert_config = os.path.join(model_dir, "sentence_bert_config.json")
    if os.path.isfile(bert_config):
        with open(bert_config, encoding="utf-8") as f:
            max_len = json.load(f).get("max_seq_length")
        if max_len:
            out["max_seq_length"] = int(max_len)
    modules_file = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_file):
        return out
    with open(modules_file, encoding="utf-8") as f:
        modules = json.load(f)
    out["normalize"] = False
    for module in modules:
        kind = module.get("type", "")
        if kind not in _ST_MODULES:
            raise ValueError(f"sentence-transformers module {kind!r} ({module.get('path')}) is not supported; "
                             f"supported: {', '.join(m.rsplit('.', 1)[1] for m in _ST_MODULES)}.")
        if kind.endswith(".Normalize"):
            out["normalize"] = True
        elif kind.endswith(".Pooling"):
            out["pooling_type"] = _st_pooling_type(os.path.join(model_dir, module.get("path", ""), "config.json"))
    return out


def _st_pooling_type(config_file: str) -> str:
    """CLS, MEAN or LAST from a sentence-transformers Pooling config.json."""
    with open(config_file, encoding="utf-8") as f:
        cfg = json.load(f)
    unsupported = [k for k in _ST_UNSUPPORTED_MODES if cfg.get(k)]
    modes = [mode for key, mode in _ST_POOLING_MODES.items() if cfg.get(key)]
    if unsupported or len(modes) != 1:
        given = [k for k in (*_ST_POOLING_MODES, *_ST_UNSUPPORTED_MODES) if cfg.get(k)]
        raise ValueError(f"{config_file}: pooling {given} is not supported; exactly one of "
                         f"{', '.join(_ST_POOLING_MODES)} is.")
    return modes[0]

