# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Inputs of one Kimi K3.1 DSA layer for the fidelity benchmark (torch only).

A recipe builds what the layer holds right after its projection GEMMs, for a
context of ``N`` cached tokens and ``Q`` decode queries that each see all of
them: the indexer query ``[Q, 32, 128]``, head weights ``[Q, 32]`` and key
``[N, 128]`` (before the k-norm), the MLA latent ``[N, 512]`` (before the
RMSNorm) and rope part ``[N, 64]``, all bf16 as the GEMMs return them; the
k-norm and latent-norm weights; and the absorbed MLA query ``[Q, H, 512 + 64]``
in fp32. Everything is drawn on the CPU from one seed (and the context), so a
GPU run sees the same numbers.

``structured``: the structure real attention has, built from 128-wide token
features. Directions below are random vectors of norm sqrt(128).

- Every key: a low-rank part that drifts with position (8 topic vectors mixed
  by ``cos(2 pi s / P_j + phi_j)``, periods log-uniform in ``[N / 8, 2 N]``: a
  slowly rotating mean), weight 0.5; a mean direction shared by all keys, 0.5;
  its own noise, 0.5.
- Heavy keys: the first 4 tokens (sinks) add 3 x a sink direction, 16 random
  tokens 2.5 x a "heavy" direction, the last 128 tokens a recency direction
  weighted ``2.5 exp(-age / 32)``; each query has 4 "needles", random earlier
  tokens that get 2.5 x a content direction of their own.
- Queries: 8 roles (sink, heavy, recent, current topic, needle 1..4). Each
  head (indexer and MLA alike) has one role, with weight 1 on that role's
  direction (the current topic's at 0.4: topic heads attend broadly), 0.3
  spread over the other roles and 0.3 of its own noise. Indexer and MLA heads
  thus look for the same keys, as DSA's indexer is trained to.
- Indexer key: the feature rotated by a random orthogonal 128 x 128 matrix,
  plus noise (0.3) and a per-channel offset (0.5 std), rounded to bf16. The
  k-norm is a LayerNorm with weight ``1 + 0.1 N(0, 1)`` and 4 outlier channels
  at x10, x15, x20, x30; bias ``0.05 N(0, 1)``. The indexer query is the head
  feature in the same rotated basis, divided by the square root of the k-norm
  weight: outlier channels then weigh 3 to 5.5x more in the scores and set
  each key's quantization scale, as outlier channels do in trained models.
  Head weights ``1 + 0.5 N(0, 1)`` per query (a few negative).
- MLA latent: the feature through a random 512 x 128 map with orthonormal
  columns (times 2) plus noise (0.5), bf16; RMSNorm weight ``1 + 0.1 N(0, 1)``
  with 8 outlier channels from x8 to x20. Rope part: the feature through a
  random 64 x 128 map with orthonormal rows plus noise (0.3), bf16. The MLA
  query is the head feature through the same maps, the latent part divided by
  the square root of the RMSNorm weight, the rope part halved, then scaled so
  that a head's logits (softmax scale ``1 / sqrt(192)``) over the context have
  a standard deviation of :data:`LOGIT_STD` on average (``logit_std``).

``structured-no-outliers``: the same without the outlier channels (both norm
weights ``1 + 0.1 N(0, 1)``), to tell the outliers' effect from the format's.

``gaussian`` (contrast): every GEMM output i.i.d. ``N(0, 1)``, norm weights
1 and bias 0, the same head-weight law and logit calibration; MLA attention
is then unrelated to what the indexer selects.

``tiny``: the tiny checkpoint's own first DSA layer
(:func:`kimi_k3_dsa_tools.tiny_checkpoint.write_tiny_checkpoint`,
read back from its safetensors). Hidden states (the structured features, the
query's roles blended into one vector, lifted to the hidden size by a random
orthonormal map, then the layer's input RMSNorm) go through ``q_a_proj`` +
``q_a_layernorm`` + ``indexer.wq_b``, ``indexer.weights_proj``,
``indexer.wk`` + ``indexer.k_norm``, ``kv_a_proj_with_mqa`` +
``kv_a_layernorm``, and the absorbed query ``q_nope @ W_uk`` (``kv_b_proj``)
of its 4 heads. Its weights are random, so this checks the formats on the
real projection path, not the statistics of a trained model.
"""

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

INDEX_HEAD_DIM = 128
INDEX_HEADS = 32
KV_LORA_RANK = 512
ROPE_DIM = 64
QK_NOPE_DIM = 128
EPS = 1e-5
# softmax scale of Kimi K3.1's MLA: 1 / sqrt(qk_nope + qk_rope).
MLA_SOFTMAX_SCALE = (QK_NOPE_DIM + ROPE_DIM) ** -0.5
# Std of one head's MLA logits (after the softmax scale) over the context in
# the calibrated recipes: a head with a few target keys then puts most of its
# attention on them (the benchmark reports how much of the dense attention
# the exact top-k holds).
LOGIT_STD = 1.5

FEATURE_DIM = 128
NUM_TOPICS = 8
NUM_SINKS = 4
NUM_HEAVY = 16
RECENT_WINDOW = 128
NUM_NEEDLES = 4
# Weights of the key feature's parts (directions of norm sqrt(128)).
TOPIC_KEY = 0.5
MEAN_KEY = 0.5
NOISE_KEY = 0.5
SINK_KEY = 3.0
HEAVY_KEY = 2.5
RECENT_KEY = 2.5
RECENT_DECAY = 32.0
NEEDLE_KEY = 2.5
# Per-head query features: the weight of the other roles (spread over them)
# and of the head's own noise, against 1 for the head's role.
ROLE_LEAK = 0.3
HEAD_NOISE = 0.3
# Norm of the current-topic target against sqrt(128) for the other roles: a
# topic head attends broadly and weakly (positional drift), not to a few keys.
TOPIC_QUERY = 0.4
RECIPES = ("structured", "structured-no-outliers", "gaussian", "tiny")


@dataclass
class LayerInputs:
    """One DSA layer's GEMM outputs for ``N`` keys and ``Q`` queries."""

    recipe: str
    index_q: torch.Tensor  # [Q, 32, 128] bf16
    index_weights: torch.Tensor  # [Q, 32] bf16
    index_k: torch.Tensor  # [N, 128] bf16, before the k-norm
    k_norm_weight: torch.Tensor  # [128] fp32
    k_norm_bias: torch.Tensor  # [128] fp32
    kv_c: torch.Tensor  # [N, 512] bf16, before the RMSNorm
    kv_norm_weight: torch.Tensor  # [512] fp32
    k_pe: torch.Tensor  # [N, 64] bf16
    q_latent: torch.Tensor  # [Q, H, 512] fp32 (absorbed q_nope)
    q_pe: torch.Tensor  # [Q, H, 64] fp32
    eps: float = EPS

    def to(self, device: torch.device | str) -> "LayerInputs":
        """A copy with every tensor on ``device``."""
        moved = {
            name: value.to(device) if isinstance(value, torch.Tensor) else value
            for name, value in vars(self).items()
        }
        return LayerInputs(**moved)


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


def _orthonormal(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Random ``rows x cols`` matrix with orthonormal columns (rows >= cols)
    or orthonormal rows (rows < cols)."""
    q, _ = torch.linalg.qr(_randn(gen, max(rows, cols), min(rows, cols)))
    return q if rows >= cols else q.T.contiguous()


def _direction(gen: torch.Generator, dim: int) -> torch.Tensor:
    """Random direction with norm ``sqrt(dim)`` (per-coordinate rms 1)."""
    v = _randn(gen, dim)
    return v * (math.sqrt(dim) / v.norm())


def _norm_weight(gen: torch.Generator, dim: int, outliers: list[float]) -> torch.Tensor:
    """``1 + 0.1 N(0, 1)`` with ``outliers`` planted in random channels,
    bf16-representable (checkpoints store norm weights in bf16)."""
    weight = 1.0 + 0.1 * _randn(gen, dim)
    channels = torch.randperm(dim, generator=gen)[: len(outliers)]
    weight[channels] = torch.tensor(outliers)
    return weight.bfloat16().float()


@dataclass
class Features:
    """Token features ``keys [N, 128]`` and each query's target directions
    ``targets [Q, roles, 128]`` (norm sqrt(128) each; see the module
    docstring)."""

    keys: torch.Tensor
    targets: torch.Tensor

    def heads(self, gen: torch.Generator, num_heads: int) -> torch.Tensor:
        """Per-head query features ``[Q, H, 128]``: each head has one role
        (weight 1), a little of every other role and its own noise."""
        nq, num_roles, dim = self.targets.shape
        roles = torch.arange(num_heads) % num_roles
        roles = roles[torch.randperm(num_heads, generator=gen)]
        mix = torch.full((num_heads, num_roles), ROLE_LEAK / math.sqrt(num_roles - 1))
        mix[torch.arange(num_heads), roles] = 1.0
        noise = _randn(gen, nq, num_heads, dim)
        return torch.einsum("hr,qrd->qhd", mix, self.targets) + HEAD_NOISE * noise

    def blended(self, gen: torch.Generator) -> torch.Tensor:
        """One query feature per token ``[Q, 128]`` (all roles at once), for
        a layer whose heads come from its own weights."""
        nq, num_roles, dim = self.targets.shape
        noise = _randn(gen, nq, dim)
        return self.targets.sum(1) / math.sqrt(num_roles) + HEAD_NOISE * noise


def _features(gen: torch.Generator, context: int, num_queries: int) -> Features:
    """Structured key features and query targets (see the module docstring)."""
    d = FEATURE_DIM
    topics = _randn(gen, NUM_TOPICS, d)
    periods = context * torch.exp2(-3.0 + 4.0 * torch.rand(NUM_TOPICS, generator=gen))
    phases = 2 * math.pi * torch.rand(NUM_TOPICS, generator=gen)

    def topic(pos: torch.Tensor) -> torch.Tensor:
        angle = 2 * math.pi * pos[:, None].double() / periods[None, :].double()
        mix = torch.cos(angle + phases[None, :].double()).float()
        return (mix @ topics) * math.sqrt(2.0 / NUM_TOPICS)

    u_mean, u_sink, u_heavy, u_recent = (_direction(gen, d) for _ in range(4))
    pos = torch.arange(context)
    f = TOPIC_KEY * topic(pos) + NOISE_KEY * _randn(gen, context, d)
    f += MEAN_KEY * u_mean
    f[: min(NUM_SINKS, context)] += SINK_KEY * u_sink
    if context > NUM_SINKS + RECENT_WINDOW:
        span = context - NUM_SINKS - RECENT_WINDOW
        heavy = NUM_SINKS + torch.randperm(span, generator=gen)[:NUM_HEAVY]
        f[heavy] += HEAVY_KEY * u_heavy
    age = (context - 1 - pos[-RECENT_WINDOW:]).float()
    decay = RECENT_KEY * torch.exp(-age / RECENT_DECAY)
    f[-RECENT_WINDOW:] += decay[:, None] * u_recent

    # Needles: per query, tokens with content of their own that it retrieves.
    needles = torch.stack(
        [
            torch.randperm(context, generator=gen)[:NUM_NEEDLES]
            for _ in range(num_queries)
        ]
    )
    content = torch.stack(
        [
            torch.stack([_direction(gen, d) for _ in range(NUM_NEEDLES)])
            for _ in range(num_queries)
        ]
    )
    planted = NEEDLE_KEY * content.flatten(0, 1)
    f.index_put_((needles.flatten(),), planted, accumulate=True)

    fixed = torch.stack([u_sink, u_heavy, u_recent])
    current = topic(torch.full((num_queries,), context))
    current *= TOPIC_QUERY * math.sqrt(d) / current.norm(dim=-1, keepdim=True)
    targets = torch.cat(
        [fixed.expand(num_queries, -1, -1), current[:, None], content], dim=1
    )
    return Features(f, targets)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _calibrate(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    k_pe: torch.Tensor,
    logit_std: float,
) -> float:
    """Scale of the MLA query that gives logits of std ``logit_std`` (mean
    over queries and heads, on up to 4096 evenly spaced keys)."""
    step = max(1, kv_c.shape[0] // 4096)
    c = _rms_norm(kv_c[::step], kv_norm_weight, EPS)
    pe = k_pe[::step].float()
    logits = (q_latent @ c.T + q_pe @ pe.T) * MLA_SOFTMAX_SCALE
    return logit_std / logits.std(dim=-1).mean().item()


def _structured(
    gen: torch.Generator,
    context: int,
    num_queries: int,
    mla_heads: int,
    outliers: bool,
    logit_std: float,
) -> LayerInputs:
    feats = _features(gen, context, num_queries)
    f, d = feats.keys, FEATURE_DIM

    w_k = _orthonormal(INDEX_HEAD_DIM, d, gen)
    offset = 0.5 * _randn(gen, INDEX_HEAD_DIM)
    index_k = f @ w_k.T + 0.3 * _randn(gen, context, INDEX_HEAD_DIM) + offset
    k_outliers = [10.0, 15.0, 20.0, 30.0] if outliers else []
    k_norm_weight = _norm_weight(gen, INDEX_HEAD_DIM, k_outliers)
    k_norm_bias = (0.05 * _randn(gen, INDEX_HEAD_DIM)).bfloat16().float()
    index_q = (feats.heads(gen, INDEX_HEADS) @ w_k.T) * k_norm_weight.rsqrt()
    index_weights = 1.0 + 0.5 * _randn(gen, num_queries, INDEX_HEADS)

    w_c = 2.0 * _orthonormal(KV_LORA_RANK, d, gen)
    kv_c = f @ w_c.T + 0.5 * _randn(gen, context, KV_LORA_RANK)
    c_outliers = torch.logspace(math.log10(8.0), math.log10(20.0), 8).tolist()
    kv_norm_weight = _norm_weight(gen, KV_LORA_RANK, c_outliers if outliers else [])
    w_pe = _orthonormal(ROPE_DIM, d, gen)
    k_pe = f @ w_pe.T + 0.3 * _randn(gen, context, ROPE_DIM)
    qg = feats.heads(gen, mla_heads)
    q_latent = (qg @ w_c.T) * kv_norm_weight.rsqrt()
    q_pe = 0.5 * (qg @ w_pe.T)

    kv_c, k_pe = kv_c.bfloat16(), k_pe.bfloat16()
    scale = _calibrate(q_latent, q_pe, kv_c, kv_norm_weight, k_pe, logit_std)
    return LayerInputs(
        recipe="structured" if outliers else "structured-no-outliers",
        index_q=index_q.bfloat16(),
        index_weights=index_weights.bfloat16(),
        index_k=index_k.bfloat16(),
        k_norm_weight=k_norm_weight,
        k_norm_bias=k_norm_bias,
        kv_c=kv_c,
        kv_norm_weight=kv_norm_weight,
        k_pe=k_pe,
        q_latent=scale * q_latent,
        q_pe=scale * q_pe,
    )


def _gaussian(
    gen: torch.Generator,
    context: int,
    num_queries: int,
    mla_heads: int,
    logit_std: float,
) -> LayerInputs:
    kv_c = _randn(gen, context, KV_LORA_RANK).bfloat16()
    k_pe = _randn(gen, context, ROPE_DIM).bfloat16()
    ones = torch.ones(KV_LORA_RANK)
    q_latent = _randn(gen, num_queries, mla_heads, KV_LORA_RANK)
    q_pe = _randn(gen, num_queries, mla_heads, ROPE_DIM)
    scale = _calibrate(q_latent, q_pe, kv_c, ones, k_pe, logit_std)
    return LayerInputs(
        recipe="gaussian",
        index_q=_randn(gen, num_queries, INDEX_HEADS, INDEX_HEAD_DIM).bfloat16(),
        index_weights=(1.0 + 0.5 * _randn(gen, num_queries, INDEX_HEADS)).bfloat16(),
        index_k=_randn(gen, context, INDEX_HEAD_DIM).bfloat16(),
        k_norm_weight=torch.ones(INDEX_HEAD_DIM),
        k_norm_bias=torch.zeros(INDEX_HEAD_DIM),
        kv_c=kv_c,
        kv_norm_weight=ones,
        k_pe=k_pe,
        q_latent=scale * q_latent,
        q_pe=scale * q_pe,
    )


def write_tiny_checkpoint_dir(seed: int = 0) -> Path:
    """A fresh tiny checkpoint in a temporary directory (about 70 MB)."""
    from kimi_k3_dsa_tools.tiny_checkpoint import write_tiny_checkpoint

    out = Path(tempfile.mkdtemp(prefix="kimi_k3_fidelity_tiny_"))
    return write_tiny_checkpoint(out, seed=seed)


def _tiny_layer_weights(checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The first DSA layer's attention weights (fp32) and the config."""
    from safetensors import safe_open

    config = json.loads((checkpoint / "config.json").read_text())
    config = config.get("text_config", config)
    layer = config["linear_attn_config"]["full_attn_layers"][0] - 1
    prefixes = (f"model.layers.{layer}.", f"language_model.model.layers.{layer}.")
    weights: dict[str, torch.Tensor] = {}
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as handle:
        for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
            for prefix in prefixes:
                if name.startswith(prefix):
                    weights[name[len(prefix) :]] = handle.get_tensor(name).float()
    return weights, config


def _tiny(
    gen: torch.Generator, context: int, num_queries: int, checkpoint: Path
) -> LayerInputs:
    w, config = _tiny_layer_weights(checkpoint)
    eps = float(config["rms_norm_eps"])
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    nope, v_dim = config["qk_nope_head_dim"], config["v_head_dim"]
    feats = _features(gen, context, num_queries)
    lift = math.sqrt(hidden / FEATURE_DIM) * _orthonormal(hidden, FEATURE_DIM, gen)
    norm_in = w["input_layernorm.weight"]
    x_k = _rms_norm(feats.keys @ lift.T, norm_in, eps).bfloat16().float()
    x_q = _rms_norm(feats.blended(gen) @ lift.T, norm_in, eps).bfloat16().float()

    def gemm(x: torch.Tensor, name: str) -> torch.Tensor:
        # bf16 GEMM output (fp32 accumulation, one rounding).
        return (x @ w[name].T).bfloat16()

    q_a = gemm(x_q, "self_attn.q_a_proj.weight")
    q_c = _rms_norm(q_a, w["self_attn.q_a_layernorm.weight"], eps).bfloat16().float()
    index_q = gemm(q_c, "self_attn.indexer.wq_b.weight")
    index_q = index_q.view(num_queries, -1, INDEX_HEAD_DIM)
    index_weights = gemm(x_q, "self_attn.indexer.weights_proj.weight")
    index_k = gemm(x_k, "self_attn.indexer.wk.weight")
    kv = gemm(x_k, "self_attn.kv_a_proj_with_mqa.weight")
    kv_c, k_pe = kv[:, :KV_LORA_RANK].contiguous(), kv[:, KV_LORA_RANK:].contiguous()
    q = gemm(q_c, "self_attn.q_b_proj.weight").float().view(num_queries, heads, -1)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    kv_b = w["self_attn.kv_b_proj.weight"].view(heads, nope + v_dim, KV_LORA_RANK)
    q_latent = torch.einsum("qhn,hnc->qhc", q_nope, kv_b[:, :nope])
    bias = w.get("self_attn.indexer.k_norm.bias", torch.zeros(INDEX_HEAD_DIM))
    return LayerInputs(
        recipe="tiny",
        index_q=index_q,
        index_weights=index_weights,
        index_k=index_k,
        k_norm_weight=w["self_attn.indexer.k_norm.weight"],
        k_norm_bias=bias,
        kv_c=kv_c,
        kv_norm_weight=w["self_attn.kv_a_layernorm.weight"],
        k_pe=k_pe,
        q_latent=q_latent,
        q_pe=q_pe.contiguous(),
        eps=eps,
    )


def make_inputs(
    recipe: str,
    context: int,
    num_queries: int,
    seed: int,
    mla_heads: int,
    tiny_checkpoint: Path | None = None,
    logit_std: float = LOGIT_STD,
) -> LayerInputs:
    """Build ``recipe``'s layer inputs on the CPU (reproducible from
    ``seed``; each (recipe, context) pair gets its own stream).
    ``logit_std`` calibrates the MLA query of the synthetic recipes."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + context)
    if recipe in ("structured", "structured-no-outliers"):
        outliers = recipe == "structured"
        return _structured(gen, context, num_queries, mla_heads, outliers, logit_std)
    if recipe == "gaussian":
        return _gaussian(gen, context, num_queries, mla_heads, logit_std)
    if recipe == "tiny":
        if tiny_checkpoint is None:
            raise ValueError("the tiny recipe needs a checkpoint directory")
        return _tiny(gen, context, num_queries, tiny_checkpoint)
    raise ValueError(f"unknown recipe {recipe!r}; choose from {RECIPES}")


def layer_norm_fp32(inputs: LayerInputs) -> torch.Tensor:
    """The k-norm in fp32, not rounded: the indexer keys' true values."""
    k = inputs.index_k.float()
    return F.layer_norm(
        k, (k.shape[-1],), inputs.k_norm_weight, inputs.k_norm_bias, inputs.eps
    )


def rms_norm_fp32(inputs: LayerInputs) -> torch.Tensor:
    """The latent RMSNorm in fp32, not rounded: the latent's true values."""
    return _rms_norm(inputs.kv_c, inputs.kv_norm_weight, inputs.eps)
