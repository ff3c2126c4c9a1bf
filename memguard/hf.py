"""Build a Hugging Face transformers model from its config on the meta device, with a batch.

``build("gpt2", {"n_layer": 2}, seq_len=128)`` makes the model of ``model_type`` from
``transformers.AutoConfig.for_model(model_type, **overrides)`` on ``torch.device("meta")``: no
weights are downloaded or allocated, so it works offline and is nearly free even for a model
of billions of parameters. ``model_type`` may also be a local checkpoint directory (its
``config.json``) or a Hub id such as ``meta-llama/Llama-3.1-8B``, whose config
``AutoConfig.from_pretrained`` reads from the local Hugging Face cache or, where the Hub can be
reached, downloads (the config alone; no weights are ever read). The result holds an example batch of token ids with labels, shaped
for the model's task, ready for :func:`memguard.estimate` and :func:`memguard.plan`.

The task, and so the auto class, follows the model type (``task="auto"``):

* encoder-decoder types (``t5``, ``bart``, ``mbart``, ``pegasus``, ...): ``"seq2seq-lm"``,
  ``AutoModelForSeq2SeqLM``; the batch is ``input_ids`` and ``attention_mask`` of ``seq_len``
  tokens and ``labels`` of ``target_len`` tokens (default ``seq_len``);
* types with a masked-LM head (``bert``, ``roberta``, ``electra``, ``deberta``, ...):
  ``"masked-lm"``, ``AutoModelForMaskedLM``; the batch is ``input_ids``, ``attention_mask``
  and ``labels`` of ``seq_len`` tokens;
* other types with a causal-LM head (``gpt2``, ``llama``, ``mistral``, ``qwen2``, ...):
  ``"causal-lm"``, ``AutoModelForCausalLM``; the batch is ``input_ids`` and ``labels``.

Labels are the input ids themselves (every position carries a loss): the logits and the
cross-entropy of every position exist whatever the labels hold, so the memory is the same as
with ``-100`` on padding or unmasked positions.

Known limitations:
    A config's defaults are those of the architecture's original checkpoint (``gpt2``: 124M,
    ``llama``: 7B, ``bert``: base, ``t5``: small); change sizes with ``overrides``. The
    attention implementation is transformers' default for a model built without a device
    (usually ``"sdpa"``); pass ``attn_implementation="eager"`` to model the eager one.
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping

import torch
from torch import nn

from memguard.errors import ConfigError, MissingDependencyError

__all__ = ["HFModel", "TASKS", "build", "make_batch", "parse_overrides", "infer_task", "config_for"]

Task = Literal["causal-lm", "masked-lm", "seq2seq-lm"]
TASKS: tuple[str, ...] = ("causal-lm", "masked-lm", "seq2seq-lm")

#: The sequence length used when none is given, capped by the model's maximum positions.
DEFAULT_SEQ_LEN = 1024

# Config keys that hold the largest sequence an absolute-position model accepts, by preference.
_MAX_POSITION_KEYS = ("n_positions", "max_position_embeddings", "n_ctx")

# Keyword arguments transformers' configs accept that are not stored under their own name.
_EXTRA_KEYS = frozenset({"attn_implementation", "dtype"})


@dataclass(frozen=True)
class HFModel:
    """A transformers model built on the meta device, with an example batch.

    Attributes:
        model: the model, in training mode, every parameter on ``meta``.
        batch: the example micro-batch (dict of CPU tensors of token ids, batch dim 0).
        config: the transformers config the model was built from.
        model_type: the ``model_type`` asked for.
        task: ``"causal-lm"``, ``"masked-lm"`` or ``"seq2seq-lm"``.
        seq_len: tokens per sample (the encoder's for ``"seq2seq-lm"``).
        target_len: decoder tokens per sample (``"seq2seq-lm"`` only, else None).
        overrides: the config values given.
    """

    model: nn.Module
    batch: dict[str, torch.Tensor]
    config: Any
    model_type: str
    task: str
    seq_len: int
    target_len: int | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_params(self) -> int:
        """Parameters of the model (tied weights counted once)."""
        return sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())

    def describe(self) -> str:
        """One line: type, class, parameter count, sequence length."""
        seq = f"sequence {self.seq_len}" + (f" -> {self.target_len}" if self.target_len is not None else "")
        return f"{self.model_type} ({type(self.model).__name__}, {self.num_params / 1e6:.1f}M parameters), {seq}"


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise MissingDependencyError("transformers", "transformers") from exc
    return transformers


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Parse ``key=value`` strings into config overrides.

    A value is read as JSON (``2``, ``0.1``, ``true``, ``null``, ``[1, 2]``), else as a Python
    literal (``True``, ``None``), else kept as a string (``attn_implementation=eager``). A key
    given twice keeps its last value.

    Raises:
        ConfigError: an item without ``=``, with an empty key or value, or several settings
            joined by commas (``a=1,b=2``: they go in separate items, ``a=1 b=2``); every bad
            item listed.
    """
    out: dict[str, Any] = {}
    problems: list[str] = []
    for item in items:
        key, sep, raw = str(item).partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key:
            problems.append(f"config override {item!r} is not key=value; write e.g. n_layer=2")
            continue
        if not raw:
            problems.append(f"config override {item!r} has no value; write e.g. {key}=2 (JSON; \"\" for an "
                            "empty string)")
            continue
        value = _parse_value(raw)
        if value == raw and _JOINED.search(raw):  # a bare string (not a quoted one) holding ",b="
            # "a=1,b=2" would set a to the string "1,b=2": almost surely meant as two settings
            parts = _JOINED_SPLIT.split(str(item).strip())
            problems.append(f"config override {item!r} joins {len(parts)} settings with commas; separate them "
                            f"with spaces: {' '.join(parts)}")
            continue
        out[key] = value
    if problems:
        raise ConfigError(problems)
    return out


# ",b=" inside a value: a second key=value after a comma.
_JOINED = re.compile(r",\s*[A-Za-z_][\w.]*\s*=")
_JOINED_SPLIT = re.compile(r"\s*,\s*(?=[A-Za-z_][\w.]*\s*=)")


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested deeper than Python's stack
        pass
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):  # literal_eval's failures
        return raw


#: The largest size or count an override may set: int32's maximum. No dimension of a trainable
#: model comes near it, and larger ones overflow torch's int64 byte counts of the tensors.
MAX_SIZE = 2**31 - 1

# Token ids (pad_token_id, eos_token_id, ...): any id, a list of ids or null; not sizes.
_TOKEN_ID = re.compile(r"(^|_)ids?$")
# A dimension of the model: zero of these builds no model (or an empty one), so at least 1. Layer
# and head counts by name (n_layer, num_hidden_layers, encoder_attention_heads, ...): other counts
# of layers may be 0 (Qwen2's max_window_layers, DeepSeek's num_nextn_predict_layers).
_DIMENSION = re.compile(
    r"(^|_)(size|dim|embd|embed|embeddings|positions|ctx|model|ff|kv|inner)$"
    r"|^(n|num)_((hidden|attention|key_value|kv|encoder|decoder)_)?(layers?|heads?)$"
    r"|^(encoder|decoder)_(attention_)?(layers|heads)$"
)


def _override_problems(config: Any, overrides: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``overrides`` for ``config`` (a model type's default config), one sentence each.

    The rules, from the default config's own values:

    * a key must be a setting of the config (or an alias in its ``attribute_map``); close matches
      are named;
    * a value takes the type of the default: true/false for a boolean, an integer for an integer
      (not ``2.0``), a number for a float, a string for a string; ``null`` passes (the config
      decides);
    * a size or count (an integer setting with a positive default other than a token id
      ``..._id``, or a dimension with no default) is at least 0 and at most :data:`MAX_SIZE`;
      a dimension (a name ending in ``size``, ``dim``, ``positions``, ... or counting layers or
      heads: ``n_layer``, ``num_hidden_layers``, ``hidden_size``, ``num_heads``, ``vocab_size``,
      ...) at least 1. A default of 0 or -1 marks a switch or a sentinel, not a size: only its
      type is checked.

    Returns:
        The problems; empty when the overrides pass.
    """
    name = type(config).__name__
    aliases = dict(getattr(config, "attribute_map", {}) or {})
    known = set(config.to_dict()) | set(aliases) | _EXTRA_KEYS
    problems: list[str] = []
    for key, value in overrides.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            problems.append(f"{name} has no setting {key!r}{hint}")
            continue
        if key in _EXTRA_KEYS or _TOKEN_ID.search(key):
            continue
        target = aliases.get(key, key)
        problem = _value_problem(key, value, getattr(config, target, None),
                                 dimension=bool(_DIMENSION.search(key) or _DIMENSION.search(target)))
        if problem:
            problems.append(f"{name}.{key} {problem}")
    return problems


def _value_problem(key: str, value: Any, default: Any, *, dimension: bool) -> str | None:
    """Why ``value`` cannot replace ``default`` (None when it can); see :func:`_override_problems`."""
    if value is None:
        return None  # e.g. num_key_value_heads=null: the config fills it in, or refuses it itself
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, bool):
        if isinstance(value, bool):
            return None
        return f"is true or false, got {value!r}; write {key}=true or {key}=false"
    if isinstance(default, int) or (dimension and default is None):
        positive = isinstance(default, int) and default > 0
        example = default if positive else 1
        if not is_int:
            return f"takes an integer, got {value!r}; write e.g. {key}={example}"
        if not (positive or (dimension and default is None)):
            return None  # a default of 0 or -1 is a switch or a sentinel, not a size
        low = 1 if dimension else 0
        if value < low:
            return f"is a size or count and must be at least {low}, got {value}; write e.g. {key}={example}"
        if value > MAX_SIZE:
            return f"must be at most {MAX_SIZE} (2**31 - 1), got {value}; write e.g. {key}={example}"
        return None
    if isinstance(default, float):
        if is_int or isinstance(value, float):
            return None
        return f"takes a number, got {value!r}; write e.g. {key}={default!r}"
    if isinstance(default, str):
        if isinstance(value, str):
            return None
        return f"takes a string, got {value!r}; write e.g. {key}={default}"
    return None


def _is_float_setting(config: Any, key: str) -> bool:
    """Whether ``key`` (or the setting it aliases) holds a float in ``config``."""
    target = (getattr(config, "attribute_map", {}) or {}).get(key, key)
    return type(getattr(config, target, None)) is float


def config_for(model_type: str, overrides: Mapping[str, Any] | None = None) -> Any:
    """``transformers.AutoConfig.for_model(model_type, **overrides)``, with checked names.

    Raises:
        ConfigError: unknown model type; override keys the config does not have (a typo such
            as ``n_layers`` for GPT-2 would otherwise be stored and silently ignored; close
            matches are named), values of the wrong type or sizes out of range (see
            :func:`_override_problems`), or values the config itself refuses.
        MissingDependencyError: transformers is not installed.
    """
    transformers = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    overrides = dict(overrides or {})
    pretrained = model_type not in CONFIG_MAPPING and _pretrained_source(model_type)
    if model_type not in CONFIG_MAPPING and not pretrained:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
        raise ConfigError(
            f"unknown transformers model type {model_type!r}; {hint}use a config's model_type such as "
            "'gpt2', 'llama', 'mistral', 'qwen2', 'bert' or 't5', a Hub id such as 'meta-llama/Llama-3.1-8B', "
            "or a checkpoint directory with a config.json"
        )
    default = _pretrained_config(model_type) if pretrained else transformers.AutoConfig.for_model(model_type)
    problems = _override_problems(default, overrides)
    if problems:
        raise ConfigError(problems)
    try:
        # JSON reads 0 as an integer: a float setting takes it as 0.0 (transformers 5 refuses an int there)
        overrides = {k: float(v) if type(v) is int and _is_float_setting(default, k) else v
                     for k, v in overrides.items()}
        if pretrained:  # from_pretrained's keyword arguments override the loaded config's values
            return transformers.AutoConfig.from_pretrained(model_type, **overrides)
        return transformers.AutoConfig.for_model(model_type, **overrides)
    except Exception as exc:  # the default config built, so the overrides are at fault (ValueError,
        # TypeError, huggingface_hub's StrictDataclassError in transformers 5, an int too large for a
        # float); one line of it
        reason = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
        raise ConfigError(f"{type(default).__name__} refused the overrides {overrides}: {reason}") from exc


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as huggingface_hub's validate_repo_id


def _pretrained_source(name: Any) -> bool:
    """Whether ``name`` is a checkpoint directory or looks like a Hub id (``owner/name``)."""
    return isinstance(name, str) and (os.path.isdir(name) or bool(_HUB_ID.match(name)))


def _pretrained_config(source: str) -> Any:
    """``AutoConfig.from_pretrained(source)``: a directory's config.json, or a Hub id's from the local
    cache or the Hub; only the config is read.

    Raises:
        ConfigError: no config.json there, the Hub cannot be reached and the cache lacks the id, or a
            config transformers cannot read; the message says how to get the config.
    """
    transformers = _transformers()
    if os.path.isdir(source) and not os.path.isfile(os.path.join(source, "config.json")):
        raise ConfigError(f"{source} has no config.json: point at a checkpoint directory (the folder "
                          "save_pretrained wrote) or give a model type such as 'llama'")
    try:
        return _from_pretrained_quietly(transformers, source)
    except OSError as exc:  # not in the cache and the Hub unreachable (or offline), or no such repository
        raise ConfigError(
            f"cannot read the config of {source!r} ({_first_line(exc)}): offline, it must be in the local Hugging "
            f"Face cache; fetch only the config once with `huggingface-cli download {source} config.json` (no "
            "weights), or pass a directory holding its config.json, or a model type with --hf-config sizes"
        ) from exc
    except ValueError as exc:  # a config.json transformers cannot map to a model type
        raise ConfigError(f"cannot read the config of {source!r}: {_first_line(exc)}") from exc


def _from_pretrained_quietly(transformers: Any, source: str) -> Any:
    """The local cache (or directory) first; the Hub only when that fails and it is not switched off
    (``HF_HUB_OFFLINE``), with huggingface_hub's retry warnings silenced (an error says it all)."""
    import logging

    try:
        return transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    except OSError:
        if os.path.isdir(source) or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            raise
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    try:
        return transformers.AutoConfig.from_pretrained(source)
    finally:
        hub_log.setLevel(level)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def _mapping_names() -> dict[str, Any]:
    from transformers.models.auto import modeling_auto

    return {
        "causal-lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "masked-lm": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        "seq2seq-lm": modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    }


def infer_task(config: Any) -> str:
    """The training task of a config's model type: see the module docstring for the order.

    Raises:
        ConfigError: the model type has no language-modelling head in transformers.
    """
    names = _mapping_names()
    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False) and model_type in names["seq2seq-lm"]:
        return "seq2seq-lm"
    # Encoder models (bert, roberta, ...) also register a causal-LM head for use as decoders;
    # their pre-training head is the masked-LM one.
    if model_type in names["masked-lm"]:
        return "masked-lm"
    if model_type in names["causal-lm"]:
        return "causal-lm"
    if model_type in names["seq2seq-lm"]:
        return "seq2seq-lm"
    raise ConfigError(
        f"transformers has no language-modelling head for model type {model_type!r}; build the model "
        "yourself and pass it with its batch (memguard.plan(model, batch, ...); on the command line "
        "--model pkg.module:factory)"
    )


def _auto_class(task: str):
    transformers = _transformers()
    return {
        "causal-lm": transformers.AutoModelForCausalLM,
        "masked-lm": transformers.AutoModelForMaskedLM,
        "seq2seq-lm": transformers.AutoModelForSeq2SeqLM,
    }[task]


def max_positions(config: Any) -> tuple[str, int] | None:
    """The config key and value bounding the sequence length, or None when there is none."""
    for key in _MAX_POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return key, value
    return None


def make_batch(config: Any, task: str, *, batch_size: int, seq_len: int, target_len: int | None = None,
               device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """An example batch of token ids with labels for ``task``.

    Token ids cycle through the vocabulary from 0 (``arange(seq_len) % vocab_size``); their
    values do not change the memory of a step.

    Raises:
        ConfigError: a size is not a positive integer.
    """
    problems = []
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            problems.append(f"{name}={value!r} must be an integer >= 1")
    if target_len is not None and not (isinstance(target_len, int) and target_len >= 1):
        problems.append(f"target_len={target_len!r} must be an integer >= 1")
    if task not in TASKS:
        problems.append(f"task={task!r} must be one of {', '.join(TASKS)}")
    if problems:
        raise ConfigError(problems)
    vocab = int(getattr(config, "vocab_size", 0) or 0) or 2

    def ids(n: int) -> torch.Tensor:
        return (torch.arange(n, dtype=torch.long, device=device) % vocab).expand(batch_size, n).contiguous()

    tokens = ids(seq_len)
    if task == "causal-lm":
        return {"input_ids": tokens, "labels": tokens.clone()}
    mask = torch.ones(batch_size, seq_len, dtype=torch.long, device=device)
    if task == "masked-lm":
        return {"input_ids": tokens, "attention_mask": mask, "labels": tokens.clone()}
    return {"input_ids": tokens, "attention_mask": mask, "labels": ids(target_len or seq_len)}


def _ensure_decoder_start(config: Any, overrides: Mapping[str, Any]) -> None:
    """Give a seq2seq config the token ids its labels-to-decoder-inputs shift needs.

    Some configs built without a checkpoint (T5's, in recent transformers) lack them; T5's
    checkpoints start the decoder with the pad token, id 0 (the t5-small config.json).
    """
    for key in ("pad_token_id", "decoder_start_token_id"):
        if key in overrides:
            continue
        if getattr(config, key, None) is None:
            fallback = getattr(config, "pad_token_id", None)
            setattr(config, key, 0 if fallback is None else fallback)


def build(
    model_type: str,
    overrides: Mapping[str, Any] | None = None,
    *,
    batch_size: int = 1,
    seq_len: int | None = None,
    target_len: int | None = None,
    task: Literal["auto", "causal-lm", "masked-lm", "seq2seq-lm"] = "auto",
) -> HFModel:
    """Build ``model_type`` on the meta device with an example batch; nothing is downloaded.

    Args:
        model_type: a transformers ``model_type`` (``"gpt2"``, ``"llama"``, ``"bert"``, ...).
        overrides: config values, e.g. ``{"n_layer": 2, "vocab_size": 1000}``. ``use_cache`` is
            False unless given (training keeps no key/value cache).
        batch_size: samples in the example batch.
        seq_len: tokens per sample; default :data:`DEFAULT_SEQ_LEN`, or the model's maximum
            positions when smaller.
        target_len: decoder tokens per sample for ``"seq2seq-lm"`` (default ``seq_len``).
        task: ``"auto"`` (see the module docstring) or a task name to force an auto class.

    Returns:
        An :class:`HFModel`.

    Raises:
        ConfigError: unknown model type or config keys, a model type without such a head, a
            sequence longer than the model's positions (the message names the key to raise),
            or bad sizes; all listed at once where they can be.
        MissingDependencyError: transformers is not installed.
    """
    overrides = dict(overrides or {})
    if task != "auto" and task not in TASKS:
        raise ConfigError(f"task={task!r} must be 'auto' or one of {', '.join(TASKS)}")
    config = config_for(model_type, overrides)
    if "use_cache" not in overrides and hasattr(config, "use_cache"):
        config.use_cache = False  # training keeps no key/value cache (HF Trainer scripts do the same)
    chosen = infer_task(config) if task == "auto" else task
    if chosen == "seq2seq-lm":
        _ensure_decoder_start(config, overrides)
    problems: list[str] = []
    bound = max_positions(config)
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, bound[1]) if bound else DEFAULT_SEQ_LEN
    if bound is not None and isinstance(seq_len, int) and seq_len > bound[1]:
        problems.append(
            f"seq_len {seq_len} exceeds {type(config).__name__}.{bound[0]}={bound[1]}; "
            f"raise it ({bound[0]}={seq_len} in the overrides; --hf-config on the command line) or use a "
            "shorter sequence"
        )
    if target_len is not None and chosen != "seq2seq-lm":
        problems.append(f"target_len applies to encoder-decoder models only; {model_type} is {chosen}")
    if problems:
        raise ConfigError(problems)
    batch = make_batch(config, chosen, batch_size=batch_size, seq_len=seq_len,
                       target_len=target_len if chosen == "seq2seq-lm" else None)
    auto = _auto_class(chosen)
    try:
        with torch.device("meta"):
            model = auto.from_config(config)
    except ValueError as exc:
        raise ConfigError(
            f"{auto.__name__} cannot build {model_type!r} ({exc}); choose another task (--hf-task) or "
            "build the model yourself (--model pkg.module:factory)"
        ) from exc
    model.train()
    return HFModel(
        model=model, batch=batch, config=config, model_type=model_type, task=chosen, seq_len=seq_len,
        target_len=(target_len or seq_len) if chosen == "seq2seq-lm" else None, overrides=overrides,
    )
