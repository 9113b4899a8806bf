"""A Hugging Face ``config.json`` of a Llama or Qwen2 model, read field by field.

Every field that changes the model's math is read, or refused by name when this model
does not implement its value; a field left out takes transformers' own default only where
that default does not depend on the checkpoint (``tie_word_embeddings``, the biases, and the
``rope_theta`` that configs before transformers 4.33 leave out). Both layouts of the rotary
settings are read: transformers 4.x's top-level ``rope_theta`` and ``rope_scaling``, and
5.x's ``rope_parameters`` (``{"rope_type", "rope_theta", ...}``).
Fields that do not change the math (token ids, ``initializer_range``, ``use_cache``,
``transformers_version``, ...) are not read.
"""

from __future__ import annotations

import dataclasses
import json

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DEFAULT_THETA = 10000.0  # transformers' LlamaConfig and Qwen2Config rope_theta default
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")
# Fields with a value this model implements only as given (others are refused by name).
NEUTRAL = {"hidden_act": "silu", "attention_dropout": 0.0, "partial_rotary_factor": 1.0,
           "use_sliding_window": False}


class ConfigError(ValueError):
  """A ``config.json`` this model cannot reproduce exactly."""


@dataclasses.dataclass(frozen=True)
class Rope:
  """Rotary embedding settings: ``rope_type`` ``"default"`` or ``"llama3"``."""
  theta: float
  rope_type: str = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def to_hf(self) -> dict:
    out = {"rope_type": self.rope_type, "rope_theta": self.theta}
    if self.rope_type == "llama3":
      out.update({k: getattr(self, k) for k in LLAMA3_KEYS})
    return out


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The fields of a Hugging Face ``LlamaConfig`` (or ``Qwen2Config``) the model uses."""
  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 128
  num_hidden_layers: int = 2
  num_attention_heads: int = 4
  num_key_value_heads: int = 2
  head_dim: int = 16
  rms_norm_eps: float = 1e-5
  rope: Rope = Rope(10000.0)
  tie_word_embeddings: bool = False
  attention_bias: bool = False   # q, k, v and o projections (Llama's attention_bias)
  qkv_bias: bool = False         # q, k and v only (Qwen2)
  mlp_bias: bool = False
  model_type: str = "llama"

  @classmethod
  def from_json(cls, path) -> "LlamaConfig":
    """The config of the ``config.json`` at ``path``; `ConfigError`, one message naming
    the file, when it is missing, not JSON, or a config this model cannot reproduce."""
    try:
      with open(path, "rb") as f:
        raw = json.load(f)
    except FileNotFoundError:
      raise ConfigError(f"{path} does not exist: a Hugging Face checkpoint directory holds "
                        f"its config.json beside its .safetensors files.") from None
    except OSError as e:
      raise ConfigError(f"{path} cannot be read: {e.strerror or e}.") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
      raise ConfigError(f"{path} is not JSON ({e}); download the checkpoint's config.json "
                        f"again.") from None
    if not isinstance(raw, dict):
      raise ConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}.")
    try:
      return from_hf(raw)
    except ConfigError as e:
      raise ConfigError(_naming(str(e), str(path))) from None

  def to_hf(self) -> dict:
    """A transformers 5.x ``config.json`` of this model."""
    out = {"architectures": [FAMILIES[self.model_type]], "model_type": self.model_type,
           "hidden_act": "silu", "max_position_embeddings": 2048,
           "rope_parameters": self.rope.to_hf(), "attention_dropout": 0.0}
    out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("rope", "qkv_bias", "model_type")})
    if self.model_type == "qwen2":
      del out["attention_bias"], out["mlp_bias"]
    return out


def _naming(message: str, path: str) -> str:
  """``message`` about "config.json" about the file at ``path`` instead, said once."""
  if message.startswith("config.json: "):
    return f"{path}: {message.removeprefix('config.json: ')}"
  if message.startswith("config.json "):
    return f"{path} {message.removeprefix('config.json ')}"
  return f"{path}: {message}"


def _get(raw: dict, key: str, kind, default=None):
  """``raw[key]`` checked to be of ``kind``; ``default`` only where transformers has one
  that does not depend on the checkpoint (None: the field is required)."""
  if key not in raw or raw[key] is None:
    if default is None:
      raise ConfigError(f"config.json has no {key!r}; a {raw.get('model_type')} config "
                        f"needs it.")
    return default
  value = raw[key]
  ok = (isinstance(value, bool) if kind is bool else
        isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
        isinstance(value, int) and not isinstance(value, bool) and value > 0)
  if not ok:
    wanted = {bool: "true or false", float: "a number"}.get(kind, "a positive integer")
    raise ConfigError(f"config.json: {key!r} is {value!r}; expected {wanted}.")
  return kind(value)


def rope_from_hf(raw: dict) -> Rope:
  """The rotary settings of either layout (5.x ``rope_parameters``, 4.x ``rope_theta`` and
  ``rope_scaling``)."""
  params, legacy = raw.get("rope_parameters"), raw.get("rope_scaling")
  if params is None:  # 4.x: rope_theta, and rope_scaling (null: no scaling)
    if legacy is not None and not isinstance(legacy, dict):
      raise ConfigError(f"config.json: rope_scaling is {legacy!r}; expected an object or null.")
    if "rope_theta" not in raw and legacy is not None:
      raise ConfigError("config.json has rope_scaling but neither rope_parameters "
                        "(transformers 5) nor rope_theta (transformers 4): the rotary base is "
                        "not stated.")
    # Configs before transformers 4.33 (Llama 2's own: rope_scaling null) state no
    # rope_theta; transformers reads them with its default base.
    params = {**(legacy or {"rope_type": "default"}),
              "rope_theta": raw.get("rope_theta", DEFAULT_THETA)}
  elif isinstance(legacy, dict) and isinstance(params, dict) and any(
      params.get(k) != v for k, v in legacy.items()):
    raise ConfigError(f"config.json has both rope_parameters ({params!r}) and rope_scaling "
                      f"({legacy!r}), which disagree; keep one of them.")
  if not isinstance(params, dict):
    raise ConfigError(f"config.json: the rope settings are {params!r}; expected an object.")
  rope_type = params.get("rope_type") or params.get("type")  # 4.x also wrote "type"
  if rope_type is None:
    raise ConfigError(f"config.json: the rope settings {params!r} name no rope_type.")
  theta = _get(params, "rope_theta", float)
  if rope_type == "default":
    return Rope(theta)
  if rope_type == "llama3":
    missing = [k for k in LLAMA3_KEYS if params.get(k) is None]
    if missing:
      raise ConfigError(f"config.json: rope_type 'llama3' needs {missing} in its rope "
                        f"settings, which are {params!r}.")
    rope = Rope(theta, "llama3", _get(params, "factor", float),
                _get(params, "low_freq_factor", float), _get(params, "high_freq_factor", float),
                _get(params, "original_max_position_embeddings", int))
    if not rope.high_freq_factor > rope.low_freq_factor:
      raise ConfigError(f"config.json: llama3 rope needs high_freq_factor > low_freq_factor, "
                        f"got {rope.high_freq_factor} and {rope.low_freq_factor}.")
    return rope
  raise ConfigError(f"config.json: rope_type {rope_type!r} is not implemented by this "
                    f"example (it implements 'default' and 'llama3'); its logits would differ "
                    f"from transformers'.")


def _check_neutral(raw: dict) -> None:
  for key, value in NEUTRAL.items():
    if key in raw and raw[key] is not None and raw[key] != value:
      raise ConfigError(f"config.json: {key}={raw[key]!r} is not implemented by this example "
                        f"(only {value!r}).")
  kinds = set(raw.get("layer_types") or ["full_attention"])
  if kinds != {"full_attention"}:
    raise ConfigError(f"config.json: layer_types holds {sorted(kinds)}; this example "
                      f"implements only 'full_attention' layers.")


def from_hf(raw: dict) -> LlamaConfig:
  """A `LlamaConfig` from a ``config.json``'s dict; `ConfigError` names what it refuses."""
  model_type = raw.get("model_type")
  if model_type not in FAMILIES:
    raise ConfigError(f"config.json: model_type {model_type!r} is not one this example "
                      f"implements ({sorted(FAMILIES)}).")
  arch = raw.get("architectures")
  if arch is not None and arch != [FAMILIES[model_type]]:
    raise ConfigError(f"config.json: architectures {arch!r}; this example implements "
                      f"{[FAMILIES[model_type]]} (a causal language model head).")
  _check_neutral(raw)
  heads = _get(raw, "num_attention_heads", int)
  hidden = _get(raw, "hidden_size", int)
  kv = _get(raw, "num_key_value_heads", int, heads)  # transformers: None means heads
  if heads % kv:
    raise ConfigError(f"config.json: num_attention_heads ({heads}) is not a multiple of "
                      f"num_key_value_heads ({kv}).")
  if "head_dim" not in raw and hidden % heads:
    raise ConfigError(f"config.json has no head_dim, and hidden_size ({hidden}) is not a "
                      f"multiple of num_attention_heads ({heads}).")
  head_dim = _get(raw, "head_dim", int, hidden // heads)
  if head_dim % 2:
    raise ConfigError(f"config.json: head_dim {head_dim} is odd; rotary embeddings need it even.")
  qwen = model_type == "qwen2"
  for key in ("attention_bias", "mlp_bias") if qwen else ():
    if raw.get(key):
      raise ConfigError(f"config.json: {key}=true in a qwen2 config, which has no such option.")
  return LlamaConfig(
      vocab_size=_get(raw, "vocab_size", int), hidden_size=hidden,
      intermediate_size=_get(raw, "intermediate_size", int),
      num_hidden_layers=_get(raw, "num_hidden_layers", int), num_attention_heads=heads,
      num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=_get(raw, "rms_norm_eps", float),
      rope=rope_from_hf(raw),
      # transformers' own defaults: Llama and Qwen2 configs default to an untied head.
      tie_word_embeddings=_get(raw, "tie_word_embeddings", bool, False) is True,
      attention_bias=False if qwen else _get(raw, "attention_bias", bool, False) is True,
      qkv_bias=qwen, mlp_bias=False if qwen else _get(raw, "mlp_bias", bool, False) is True,
      model_type=model_type)
