"""attnkern as an attention backend of Hugging Face `transformers`.

    import attnkern.integrations.transformers as ak_hf
    ak_hf.register()                       # once per process, before models are built or loaded
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attnkern_entmax15")
    # or, on a model you already have (a learnable α per layer and head):
    ak_hf.configure(model, normalizer="entmax", alpha="learnable", alpha_init=1.5)

register() adds these names to transformers' AttentionInterface, each with
the boolean-mask builder of the "sdpa" backend in its AttentionMaskInterface
(so padding and sliding windows reach the kernels as a mask, and causal
attention without padding as `is_causal`):
  "attnkern_softmax", "attnkern_sparsemax", "attnkern_entmax15": fixed normalizers;
  "attnkern": the normalizer and α stored in the model's config by configure().
configure() keeps its settings in `model.config.attnkern` (a dict, saved by
save_pretrained); a learnable α is a parameter `attnkern_alpha.theta` of each
attention module, and from_pretrained() in this module restores both.

A query with no allowed key (a padding row) gets zeros here, where the eager
backend gives uniform weights and "sdpa" whatever PyTorch's kernel gives:
compare models on non-padding positions only.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch

from attnkern.attention import attention
from attnkern.family import Family, takes_alpha
from attnkern.nn.normalizers import EntmaxAlpha
from attnkern.validation import check_module_alpha

# The attention-implementation names register() adds, with their fixed
# normalizer (None: read from the model's config, set by configure()).
IMPLEMENTATIONS: dict[str, str | None] = {
    "attnkern": None,
    "attnkern_softmax": "softmax",
    "attnkern_sparsemax": "sparsemax",
    "attnkern_entmax15": "entmax15",
}
# The attribute of the model config holding configure()'s settings.
CONFIG_FIELD = "attnkern"
# The submodule of each attention module holding a learnable α.
ALPHA_MODULE = "attnkern_alpha"


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("attnkern.integrations.transformers needs the `transformers` package "
                          "(pip install 'attnkern[transformers]')") from exc
    return transformers


def register() -> None:
    """Add attnkern's attention functions (and their mask builders) to
    transformers' global interfaces. Idempotent."""
    _transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name, normalizer in IMPLEMENTATIONS.items():
        AttentionInterface.register(name, _attention_function(name, normalizer))
        AttentionMaskInterface.register(name, sdpa_mask)


def _attention_function(name: str, fixed_normalizer: str | None):
    def attnkern_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                   is_causal=None, position_bias=None, **kwargs):
        return _forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, position_bias,
                        name, fixed_normalizer, kwargs)

    attnkern_attention_forward.__qualname__ = attnkern_attention_forward.__name__ = \
        f"{name}_attention_forward"
    return attnkern_attention_forward


def _settings(module, name: str, fixed_normalizer: str | None):
    """(normalizer, alpha) for this call: the implementation's own normalizer,
    or the configured one with a fixed α or the module's learnable α."""
    if fixed_normalizer is not None:
        return fixed_normalizer, None
    settings = getattr(getattr(module, "config", None), CONFIG_FIELD, None)
    if not settings:
        raise ValueError(f"attn_implementation={name!r} reads its normalizer from the model config: call "
                         f"attnkern.integrations.transformers.configure(model, normalizer=...) first, or use one "
                         f"of {[n for n, v in IMPLEMENTATIONS.items() if v]}")
    normalizer, alpha = settings["normalizer"], settings.get("alpha")
    if alpha == "learnable":
        alpha_module = getattr(module, ALPHA_MODULE, None)
        if alpha_module is None:
            raise ValueError(f"{type(module).__name__} has no learnable α although the config asks for one: "
                             f"build the model with attnkern.integrations.transformers.configure() or load it "
                             f"with attnkern.integrations.transformers.from_pretrained()")
        alpha = alpha_module.alpha
    return normalizer, alpha


def _forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, position_bias, name,
             fixed_normalizer, kwargs):
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"attn_implementation={name!r} does not support `{unsupported}` "
                             f"({type(module).__name__} passed one)")
    normalizer, alpha = _settings(module, name, fixed_normalizer)
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.to(query.device)
    L = query.shape[2]
    # As transformers' sdpa backend: `is_causal` only for a query block of
    # more than one token without a mask; then the keys a causal query block
    # cannot see (an empty static cache's tail) are cut off.
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(L > 1 and attention_mask is None and is_causal)
    if is_causal and key.shape[2] > L:
        key, value = key[:, :, :L], value[:, :, :L]
        if position_bias is not None:
            position_bias = position_bias[..., :L]
    if position_bias is not None:
        attention_mask = _with_position_bias(position_bias, attention_mask, is_causal, L, key.shape[2])
        is_causal = False
    return_weights = bool(kwargs.get("output_attentions")) or _attentions_recorded()
    res = attention(query, key, value, attn_mask=attention_mask, dropout_p=float(dropout), is_causal=is_causal,
                    scale=scaling, enable_gqa=query.shape[1] != key.shape[1], normalizer=normalizer, alpha=alpha,
                    return_weights=return_weights)
    out, weights = res if return_weights else (res, None)
    # (B, H, L, E) -> (B, L, H, E), the layout the model's output projection reads.
    return out.transpose(1, 2).contiguous(), weights


def _with_position_bias(position_bias, attention_mask, is_causal: bool, L: int, S: int):
    """One additive float mask from a position bias (T5-style models) and the
    boolean or additive mask, or causality, it comes with."""
    if attention_mask is None and is_causal:
        attention_mask = torch.ones(L, S, dtype=torch.bool, device=position_bias.device).tril()
    if attention_mask is None:
        return position_bias
    if attention_mask.dtype == torch.bool:
        return position_bias.masked_fill(~attention_mask, float("-inf"))
    return position_bias + attention_mask


def _attentions_recorded() -> bool:
    """Whether the model is collecting attention weights (output_attentions=True
    reaches attention functions through transformers' output-capturing hooks,
    not always as an argument)."""
    collector = _output_collector()
    collected = collector.get() if collector is not None else None
    return collected is not None and "attentions" in collected


@functools.cache
def _output_collector():
    """transformers' collector of captured outputs, or None in versions without one."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


# --- per-model configuration -------------------------------------------------------------------------


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` whose forward dispatches through transformers'
    AttentionInterface (where attnkern runs and a learnable α lives)."""
    return [m for m in model.modules() if hasattr(m, "config") and _dispatches_through_interface(type(m))]


@functools.cache
def _dispatches_through_interface(cls: type) -> bool:
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def configure(model, normalizer: str = "entmax15", alpha=None, alpha_init: float = 1.5) -> None:
    """Switch `model` (a transformers PreTrainedModel) to attnkern attention.

    normalizer: "softmax", "sparsemax", "entmax15" or "entmax"; alpha (entmax
    only): a float > 0, one α for every layer and head, or "learnable": one α
    per layer and head, α = 1 + sigmoid(θ) in (1, 2), starting at alpha_init,
    a parameter `attnkern_alpha.theta` of each attention module (so optimizers
    built afterwards and state_dict() see it). The settings go to
    `model.config.attnkern`; the model's attention implementation becomes
    "attnkern". Call register() first.
    """
    _transformers()
    Family.of(normalizer)
    check_module_alpha(normalizer, alpha)
    if not getattr(type(model), "is_backend_compatible", lambda: False)():
        raise TypeError(f"{type(model).__name__} does not route its attention through transformers' "
                        f"AttentionInterface, so attnkern cannot replace it")
    modules = attention_modules(model)
    if not modules:
        raise TypeError(f"no attention module of {type(model).__name__} dispatches through transformers' "
                        f"AttentionInterface")
    settings = {"normalizer": normalizer}
    if takes_alpha(normalizer):
        settings["alpha"] = alpha if alpha == "learnable" else float(alpha)
        if alpha == "learnable":
            settings["alpha_init"] = float(alpha_init)
    for m in modules:
        if alpha == "learnable":
            heads = m.config.num_attention_heads
            ref = next(m.parameters(), None)
            dtype = ref.dtype if ref is not None and ref.is_floating_point() else None
            alpha_module = EntmaxAlpha(heads, alpha_init, device=ref.device if ref is not None else None,
                                       dtype=dtype)
            setattr(m, ALPHA_MODULE, alpha_module)
        elif hasattr(m, ALPHA_MODULE):
            delattr(m, ALPHA_MODULE)
    for config in {id(m.config): m.config for m in [model, *modules]}.values():
        setattr(config, CONFIG_FIELD, dict(settings))
    model.set_attn_implementation("attnkern")


def from_pretrained(model_class, path, **kwargs):
    """`model_class.from_pretrained(path, **kwargs)` for a model saved after
    configure(): the attnkern settings in its config are applied again, and
    the learnable α values restored from the checkpoint (transformers does
    not know these parameters, so its own loader skips them)."""
    _transformers()
    config = kwargs.get("config")
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
    settings = getattr(config, CONFIG_FIELD, None)
    if settings:
        kwargs.setdefault("attn_implementation", "attnkern")
    model = model_class.from_pretrained(path, **kwargs)
    if settings:
        configure(model, **settings)
        if settings.get("alpha") == "learnable":
            _load_alpha(model, path)
    return model


def _load_alpha(model, path) -> None:
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {path}: the learnable α cannot be restored")
    wanted = {k: p for k, p in model.named_parameters() if f"{ALPHA_MODULE}." in k}
    found = {}
    for f in files:
        found.update({k: v for k, v in load_file(os.path.join(path, f)).items() if k in wanted})
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise KeyError(f"the checkpoint in {path} has no values for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    with torch.no_grad():
        for k, p in wanted.items():
            p.copy_(found[k])
